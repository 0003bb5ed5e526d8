"""fairseq's inverse_sqrt learning-rate schedule, which the WMT depth papers train with (BranchNorm's
Appendix B: 4,000 warmup updates from 1e-7 to 5e-4), as a scheduler type of the DeepSpeed config;
DeepSpeed 0.19.8 has none that decays so:

    "scheduler": {"type": "InverseSqrtLR",
                  "params": {"warmup_min_lr": 1e-7, "warmup_max_lr": 5e-4, "warmup_num_steps": 4000}}

Its arguments are WarmupLR's, but for warmup_type (linear, as fairseq's). DeepSpeed's engine receives the
config without it and the scheduler as its client scheduler (`client_scheduler`), which it steps after
every update and saves in every checkpoint like its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

NAME = "InverseSqrtLR"


class InverseSqrtLR:
    """After `n` updates the rate is fairseq's for num_updates = n: linear from warmup_min_lr to
    warmup_max_lr (default: the optimizer's lr) over warmup_num_steps, then warmup_max_lr *
    sqrt(warmup_num_steps / n). DeepSpeed's interface: it steps the scheduler once after each update, so
    at last_batch_iteration k, k + 1 updates are done (and -1 is before the first)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 4000,
        last_batch_iteration: int = -1,
    ) -> None:
        # as DeepSpeed's WarmupLR refuses it: 0 or less divided by zero in rate(), 2.5 passed for a count
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.optimizer = optimizer
        self.min_lr, self.warmup_num_steps = warmup_min_lr, warmup_num_steps
        self.max_lrs = [warmup_max_lr if warmup_max_lr is not None else g["lr"] for g in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._set_rates()

    def rate(self, updates: int, max_lr: float) -> float:
        if updates < self.warmup_num_steps:
            return self.min_lr + updates * (max_lr - self.min_lr) / self.warmup_num_steps
        return max_lr * math.sqrt(self.warmup_num_steps / updates)

    def get_lr(self) -> list[float]:
        return [self.rate(self.last_batch_iteration + 1, max_lr) for max_lr in self.max_lrs]

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def _set_rates(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._set_rates()

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


def is_ours(ds: dict[str, Any]) -> bool:
    scheduler = ds.get("scheduler")
    return isinstance(scheduler, dict) and scheduler.get("type") == NAME


def client_scheduler(ds: dict[str, Any]) -> Callable[[torch.optim.Optimizer], InverseSqrtLR] | None:
    """What deepspeed.initialize takes as lr_scheduler for the config `ds`: fathom's scheduler, built
    on the optimizer DeepSpeed builds, or None where DeepSpeed builds its own."""
    return functools.partial(InverseSqrtLR, **ds["scheduler"].get("params", {})) if is_ours(ds) else None
