"""Byte counts as the planner, the memory report and "auto" checkpointing print them."""

GiB = 2**30


def size_text(size: float) -> str:
    """Bytes for a line: GiB from 1 GiB, MiB below (a CPU test's budget is a fraction of a GiB)."""
    return f"{size / GiB:.2f} GiB" if size >= GiB else f"{size / 2**20:.1f} MiB"
