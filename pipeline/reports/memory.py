"""What each pipeline stage's process held at its peak, measured the way the planner predicts it:
bytes allocated by torch on a GPU; on a CPU the process's resident set, less what it held before
the model was built (the interpreter, torch, DeepSpeed and gloo, the same for every model)."""

from __future__ import annotations

import json
import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fathom.common.run_layout import MEMORY_FILE

GiB = 2**30


def current_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass
class MeasuredPeak:
    rank: int
    stage: int
    baseline: int  # bytes held before the model was built
    peak: int  # the process's high-water mark, baseline included

    @property
    def model_bytes(self) -> int:
        return self.peak - self.baseline


def report_peaks(baseline: int, stage: int, save_dir: Path) -> list[MeasuredPeak]:
    """Gathers every rank's peak; global rank 0 prints one line per rank and writes memory.json."""
    mine = MeasuredPeak(dist.get_rank(), stage, baseline, peak_bytes())
    peaks: list[MeasuredPeak | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mine)
    if dist.get_rank() == 0:
        for p in peaks:
            print(
                f"fathom: rank {p.rank} (stage {p.stage}) peak memory {p.peak / GiB:.2f} GiB, "
                f"{p.model_bytes / GiB:.2f} GiB above the {p.baseline / GiB:.2f} GiB before the model",
                flush=True,
            )
        (save_dir / MEMORY_FILE).write_text(json.dumps([asdict(p) for p in peaks], indent=2) + "\n")
    return peaks
