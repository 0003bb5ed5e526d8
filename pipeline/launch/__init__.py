"""Starting a job: the launch command (scripts/launch.py), the checks a run passes before any process group
exists, the hosts asked first, and the runner supervised so that a stop reaches the ranks."""
