"""Starting a job: the launch command (scripts/launch.py), the checks a run passes before any process group
exists, and the distributed set-up every rank runs, with how a launched process exits."""
