"""Step hooks: callables the training loop runs with the global step before every optimizer step.

They run on every stage and take the step from the engine, so after a resume each value is
recomputed from the restored step count, never read back from a stale buffer.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from model.norms import StepScheduled


class StepHook(Protocol):
    def __call__(self, step: int) -> None: ...


class ScheduleHook:
    """Moves every StepScheduled module of this stage (e.g. BranchNorm's alpha_t) to the step."""

    def __init__(self, module: nn.Module):
        self.scheduled = [m for m in module.modules() if isinstance(m, StepScheduled)]

    def __call__(self, step: int) -> None:
        for module in self.scheduled:
            module.set_step(step)
