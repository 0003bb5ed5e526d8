"""Admin's profiling pass through the pipeline engine (the formulas are in model/admin.py).

Every stage records the variances of its own sublayers during one forward-only `eval_batch`;
the records are then gathered over the stages of the pipeline, so each stage sums the variances
of all sublayers before its own, wherever they ran, and a run with any stage count sets the
omegas a single-process profile sets.
"""

from __future__ import annotations

from pathlib import Path

import deepspeed
import torch.distributed as dist
from torch import nn

from fathom.common.run_layout import PROFILE_FILE
from fathom.corpus.batches import MicroBatch
from fathom.model.admin import (
    Variances,
    apply_omegas,
    dropout_during,
    load_profile,
    omegas_from,
    recording,
    save_profile,
)
from fathom.model.model_config import ModelConfig
from fathom.model.norms import AdminResidual, build_scheme
from fathom.model.parts import saved_names


def stage_residuals(module: nn.Module, cfg: ModelConfig) -> dict[str, AdminResidual]:
    """This stage's residual modules under their single-process names (the pipeline names a layer
    by its index in the spec list: '5.ffn_residual' is encoder.layers.4.ffn_residual)."""
    names = saved_names(cfg)
    residuals = {}
    for local, m in module.named_modules():
        if isinstance(m, AdminResidual):
            index, rest = local.split(".", 1)
            residuals[f"{names[int(index)]}.{rest}"] = m
    return residuals


def profile_pipeline(
    engine: deepspeed.PipelineEngine, residuals: dict[str, AdminResidual], batch: MicroBatch, dropout: bool
) -> Variances:
    """The variances of every sublayer of the model, on every rank, from this stage's `residuals`."""
    with recording(residuals) as record, dropout_during(engine.module, dropout):
        engine.eval_batch(iter([batch]), num_micro_batches=1)
    stages = [None] * engine.grid.get_pipe_parallel_world_size()
    dist.all_gather_object(stages, record, group=engine.grid.get_pipe_parallel_group())
    return {name: values for stage in stages for name, values in stage.items()}


def reused_profile(cfg: ModelConfig) -> str | None:
    """The saved profile the scheme's profiling names (model.admin.profile), else None."""
    profiling = build_scheme(cfg).profiling()
    return None if profiling is None else profiling.saved


def check(cfg: ModelConfig) -> None:
    """Fails before any process trains on a model.admin.profile that does not fit the model."""
    if reuse := reused_profile(cfg):
        load_profile(reuse, cfg)


def initialize(engine: deepspeed.PipelineEngine, cfg: ModelConfig, batch: MicroBatch, save_dir: Path) -> str:
    """Sets every omega of this stage, from model.admin.profile or by profiling `batch` (then saved
    as save_dir/admin_profile.json); returns a line saying which."""
    residuals, profiling = stage_residuals(engine.module, cfg), build_scheme(cfg).profiling()
    if profiling.saved:
        omegas = load_profile(profiling.saved, cfg)
        message = f"admin omegas from {profiling.saved}"
    else:
        variances = profile_pipeline(engine, residuals, batch, profiling.dropout)
        omegas = omegas_from(variances, cfg)
        if dist.get_rank() == 0:
            save_profile(save_dir / PROFILE_FILE, variances, omegas)
        pairs = len(batch[1])
        message = f"admin omegas profiled on the first micro-batch ({pairs} pairs), saved to {save_dir / PROFILE_FILE}"
    apply_omegas(residuals, omegas)
    # ZeRO and mixed precision keep fp32 master copies that the next step would write back over
    # the new omegas; refresh them as DeepSpeed's own module-only checkpoint load does.
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()
    return message
