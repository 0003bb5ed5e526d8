"""Everything fathom changes in DeepSpeed's pipeline engine, in the order it is applied.

The engine is patched from outside, never subclassed (every DeepSpeed internal it touches is in
pipeline/engine/internals.py). Several patches wrap the same things, the engine's instructions and
each layer's call, and the one applied last runs outermost, so the order is part of what a run does:

1. `patch_engine`, as soon as the engine is built, before anything loads: the joined backward, receive
   buffers that keep their dtype, ZeRO's one-pass gradient scans, no all-reduce on one replica, the
   crash-safe checkpoint engine, which the resume's load already reads through, and fathom's
   zero_to_fp32.py in every save_dir for DeepSpeed's.
2. `patch_training`, once the start point is loaded (and Admin profiled, in eval mode, without them):
   the dropout masks, which reseed each layer's call and replace the checkpoint function; the stability
   guard, whose hooks see the masked layers' outputs and whose check runs before ZeRO's in the model
   step; and last the time breakdown, which wraps every instruction the others run inside, so it times
   them too.

scripts/train.py, the benchmarks' engine (tools/step_profile.py) and the tests' in-process runs all
train through these two functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed

from fathom.corpus.batches import DataPosition
from fathom.model.model_config import ModelConfig
from fathom.pipeline.checkpoint import saving
from fathom.pipeline.checkpoint.consolidated import write_recovery_scripts
from fathom.pipeline.engine.internals import (
    backward_in_one_call,
    replace_recovery_scripts,
    set_gradient_scans,
    set_self_reduction,
    typed_receive_buffers,
)
from fathom.pipeline.engine.recompute import DropoutMasks
from fathom.pipeline.reports.time_breakdown import TimeBreakdown
from fathom.pipeline.safety.divergence import StabilityGuard


def patch_engine(engine: deepspeed.PipelineEngine) -> None:
    """What a built engine gets before it loads or runs anything (docs/TRAINING.md, "Settings fathom picks
    for the engine")."""
    backward_in_one_call(engine)
    typed_receive_buffers(engine)
    set_gradient_scans(engine, fused=True)
    set_self_reduction(engine, skipped=True)
    saving.install(engine)
    replace_recovery_scripts(engine, write_recovery_scripts)


@dataclass
class TrainingPatches:
    masks: DropoutMasks
    guard: StabilityGuard
    breakdown: TimeBreakdown | None


def patch_training(
    engine: deepspeed.PipelineEngine,
    model: ModelConfig,
    seed: int,
    position: DataPosition,
    grad_norm_interval: int = 0,
    write_norms: Callable[[dict[str, Any]], None] | None = None,
    breakdown_dir: Path | None = None,
) -> TrainingPatches:
    """What the training loop steps with: dropout masks from (seed, micro-batch, layer) read at `position`,
    the stability guard (per-layer gradient norms to `write_norms` every `grad_norm_interval` steps), and
    a time breakdown logged in `breakdown_dir` if one is given."""
    masks = DropoutMasks(engine, seed, position)
    guard = StabilityGuard(engine, model, grad_norm_interval, write_norms)
    breakdown = TimeBreakdown(engine, breakdown_dir, engine.global_steps) if breakdown_dir else None
    return TrainingPatches(masks, guard, breakdown)
