"""What each pipeline stage's process held at its peak, measured the way the planner predicts it:
bytes allocated by torch on a GPU; on a CPU the process's resident set, less what it held before
the model was built (the interpreter, torch, DeepSpeed and gloo, the same for every model). Where
activation checkpointing was chosen at launch ("auto"), the choice and its estimate are recorded beside it."""

from __future__ import annotations

import json
import os
import resource
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from fathom.common.run_layout import MEMORY_FILE
from fathom.common.sizes import GiB
from fathom.pipeline.config.checkpoint_choice import CheckpointChoice


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
    # Where "auto" chose the checkpoint interval (None otherwise, and in records written before it): the
    # interval, the estimate of this rank's stage (to compare with model_bytes) and what it had to fit in.
    checkpoint_interval: int | None = None
    estimated_peak: int | None = None
    usable_memory: int | None = None

    @property
    def model_bytes(self) -> int:
        return self.peak - self.baseline


def report_peaks(
    baseline: int, stage: int, save_dir: Path, choice: CheckpointChoice | None = None
) -> list[MeasuredPeak]:
    """Gathers every rank's peak; global rank 0 prints one line per rank and writes memory.json, each rank's
    entry with "auto"'s `choice` and its stage's estimate, if there was one."""
    mine = MeasuredPeak(dist.get_rank(), stage, baseline, peak_bytes())
    if choice is not None:
        mine = replace(mine, checkpoint_interval=choice.interval, estimated_peak=choice.estimated_peaks[stage],
                       usable_memory=choice.usable)  # fmt: skip
    peaks: list[MeasuredPeak | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mine)
    if dist.get_rank() == 0:
        for p in peaks:
            estimated = "" if p.estimated_peak is None else f" (estimated {p.estimated_peak / GiB:.2f} GiB)"
            print(
                f"fathom: rank {p.rank} (stage {p.stage}) peak memory {p.peak / GiB:.2f} GiB, "
                f"{p.model_bytes / GiB:.2f} GiB above the {p.baseline / GiB:.2f} GiB before the model{estimated}",
                flush=True,
            )
        (save_dir / MEMORY_FILE).write_text(json.dumps([asdict(p) for p in peaks], indent=2) + "\n")
    return peaks
