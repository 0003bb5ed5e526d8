"""The memory planner: what each pipeline stage of a run will hold at its peak, known before a job is
queued (scripts/estimate_memory.py)."""
