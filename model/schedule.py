"""Values that move with the optimizer step (BranchNorm's alpha_t): the modules that hold one, and the hook
that moves them on every stage before each step."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class StepScheduled(Protocol):
    """A module whose behaviour depends on the global optimizer step (moved by a step hook)."""

    def set_step(self, step: int) -> None: ...


class ScheduleHook:
    """Moves every StepScheduled module of this stage (e.g. BranchNorm's alpha_t) to the step."""

    def __init__(self, module: nn.Module):
        self.scheduled = [m for m in module.modules() if isinstance(m, StepScheduled)]

    def __call__(self, step: int) -> None:
        for module in self.scheduled:
            module.set_step(step)
