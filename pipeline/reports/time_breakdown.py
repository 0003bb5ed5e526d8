"""Where a training step's time goes, per rank and pipeline instruction (train.time_breakdown).

DeepSpeed's own `wall_clock_breakdown` asserts in its 0.19 pipeline engine, so the engine's
instructions (forward, backward, the sends and receives between stages, the gradient reductions and
the optimizer step) are timed here instead. A receive or a send includes waiting for the other
stage, so idle time shows up there; activation checkpointing's recomputation is part of backward.
Every rank's times are gathered each step into SAVE_DIR/time_breakdown.jsonl, and the run ends with
one line per rank of the mean milliseconds per step.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from fathom.common.run_layout import TIME_BREAKDOWN_FILE
from fathom.pipeline.engine.internals import wrap_instructions
from fathom.pipeline.reports.metrics import MetricsLog

# The first steps of a run allocate buffers (and compile layers): left out of the summary when the run
# has more steps than this.
WARMUP_STEPS = 3


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class TimeBreakdown:
    """Times each pipeline instruction of `engine` within each training step (`step`, around it) on
    every rank; global rank 0 logs them all and sums them up in `summary`."""

    def __init__(self, engine: deepspeed.PipelineEngine, save_dir: Path, resume_step: int):
        self.engine, self.rank = engine, dist.get_rank()
        self.names = [snake_case(name) for name in wrap_instructions(engine, self._timed)]
        self.seconds = dict.fromkeys(self.names, 0.0)
        self.log = MetricsLog(save_dir / TIME_BREAKDOWN_FILE, self.rank == 0, resume_step)
        self.records: list[dict[str, Any]] = []

    def _timed(self, name: str, method: Callable) -> Callable:
        key = snake_case(name)

        def timed(engine: deepspeed.PipelineEngine, **kwargs: Any) -> None:
            tick = time.perf_counter()
            method(engine, **kwargs)
            self.seconds[key] += time.perf_counter() - tick

        return timed

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Times one training step; then gathers its times from every rank, and rank 0 logs them."""
        self.seconds = dict.fromkeys(self.names, 0.0)
        started = time.perf_counter()
        yield
        elapsed = time.perf_counter() - started
        values = [self.engine.grid.get_stage_id(), elapsed, *(self.seconds[name] for name in self.names)]
        mine = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        ranks = []
        for rank, row in enumerate(gathered):
            stage, *seconds = row.tolist()
            ms = dict(zip(["step", *self.names], (round(s * 1e3, 3) for s in seconds), strict=True))
            ranks.append({"rank": rank, "stage": int(stage), **ms})
        record = {"step": self.engine.global_steps, "ms": ranks}
        self.log.write(record)
        self.records.append(record)

    def summary(self) -> list[str]:
        """One line per rank: its mean milliseconds per step in each instruction, busiest first."""
        records = self.records[WARMUP_STEPS:] if len(self.records) > WARMUP_STEPS else self.records
        if not records:
            return []
        first, last = records[0]["step"], records[-1]["step"]
        lines = [f"fathom: where a step's time went, mean ms per step of steps {first}-{last} (train.time_breakdown):"]
        for rank in range(len(records[0]["ms"])):
            rows = [record["ms"][rank] for record in records]
            mean = {key: sum(row[key] for row in rows) / len(rows) for key in ["step", *self.names]}
            busiest = sorted(self.names, key=lambda name: -mean[name])
            other = mean["step"] - sum(mean[name] for name in self.names)
            times = " | ".join(f"{name} {mean[name]:.1f}" for name in busiest if mean[name] >= 0.05)
            step, stage = mean["step"], rows[0]["stage"]
            lines.append(f"fathom:   rank {rank} (stage {stage}): step {step:.1f} | {times} | other {other:.1f}")
        return lines
