"""DeepSpeed's half of a run's config as fathom reads it: one typed view of the checked dict, each value the
one DeepSpeed's engine applies. A key the config leaves out takes DeepSpeed's own default, read from its
constants and classes rather than retyped, or fathom's where fathom sets one for the engine
(engine_defaults.py). Outside pipeline/config/ nothing reads DeepSpeed's keys by string:
`RunConfig.settings` is this view (tests/test_deepspeed_settings.py holds it to a built engine's values).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from fathom.pipeline.config import inverse_sqrt
from fathom.pipeline.config.deepspeed_values import (
    BATCH_KEYS,
    CHECKPOINT_INTERVAL,
    accumulation,
    precision,
    zero_optimization_stage,
)
from fathom.pipeline.config.engine_defaults import engine_config


@dataclass(frozen=True)
class Optimizer:
    type: str
    params: dict[str, Any]

    @property
    def lr(self) -> float:
        return self.params["lr"]


@dataclass(frozen=True)
class Scheduler:
    type: str
    params: dict[str, Any]
    warmup_num_steps: int | None  # the params', else the scheduler's own default; None: it has no warmup


@dataclass(frozen=True)
class DeepSpeedSettings:
    micro_batch_size: int  # train_micro_batch_size_per_gpu: sentences a micro-batch without data.max_tokens
    batch: dict[str, int]  # the batch keys the config gives, from which accumulation() derives the rest
    gradient_clipping: float  # 0: none
    precision: str  # fp32, bf16 or fp16
    zero_stage: int
    stages: int
    checkpoint_interval: int | str  # pipeline.activation_checkpoint_interval: layers, 0 none, or "auto"
    use_reentrant: bool
    optimizer: Optimizer | None
    scheduler: Scheduler | None
    comms_logger: bool

    def accumulation(self, replicas: int) -> int:
        """Micro-batches each replica accumulates per step, as DeepSpeed derives it when not given."""
        return accumulation(self.batch, replicas)


def scheduler_settings(section: dict[str, Any] | None) -> Scheduler | None:
    """The scheduler section, its warmup defaulting to the class's own (DeepSpeed's, or fathom's InverseSqrtLR)."""
    if not section:
        return None
    from deepspeed.runtime import lr_schedules

    params = section.get("params", {})
    name = section["type"]
    scheduler_class = inverse_sqrt.InverseSqrtLR if name == inverse_sqrt.NAME else getattr(lr_schedules, name)
    parameter = inspect.signature(scheduler_class).parameters.get("warmup_num_steps")
    return Scheduler(name, params, params.get("warmup_num_steps", None if parameter is None else parameter.default))


def deepspeed_settings(ds: dict[str, Any]) -> DeepSpeedSettings:
    """The typed view of a checked DeepSpeed config `ds`, as the engine receives it (engine_config)."""
    from deepspeed.runtime.config import get_pipeline_config
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    engine = engine_config(ds)
    pipeline = {**get_pipeline_config({}), **engine["pipeline"]}
    optimizer = engine.get("optimizer")
    return DeepSpeedSettings(
        micro_batch_size=ds["train_micro_batch_size_per_gpu"],
        batch={key: ds[key] for key in BATCH_KEYS if key in ds},
        gradient_clipping=float(ds.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)),
        precision=precision(ds),
        zero_stage=zero_optimization_stage(ds),
        stages=pipeline["stages"],
        checkpoint_interval=pipeline[CHECKPOINT_INTERVAL],
        use_reentrant=pipeline["use_reentrant"],
        optimizer=None if optimizer is None else Optimizer(optimizer["type"], optimizer.get("params", {})),
        scheduler=scheduler_settings(ds.get("scheduler")),
        comms_logger=bool(ds.get("comms_logger", {}).get("enabled")),
    )
