"""DeepSpeed's values that a pipeline run depends on, checked before launch the way the engine would
fail on them, or where it would not fail at all (a schedule that ends before the run, a monitor whose
package is missing). Which keys DeepSpeed reads at all is pipeline/config/deepspeed_keys.py's."""

from __future__ import annotations

import importlib.util
import inspect
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fathom.common.errors import ConfigError, unknown_key_error
from fathom.common.machine import native_bf16_cpu
from fathom.common.outputs import check_makeable
from fathom.common.sections import check_value
from fathom.model.model_config import ModelConfig
from fathom.pipeline.config.deepspeed_keys import check_deepspeed_keys, pipeline_defaults
from fathom.pipeline.config.deepspeed_sections import check_sections
from fathom.pipeline.config.engine_defaults import engine_config

OUR_SECTIONS = ("model", "data", "train")  # the config's sections that are fathom's, not DeepSpeed's
DEFAULT_PARTITION = "cost"  # pipeline/parts/stage_cuts.py
CHECKPOINT_INTERVAL = "activation_checkpoint_interval"  # of the pipeline section
# pipeline.activation_checkpoint_interval chosen at launch to fit the memory (pipeline/parts/auto_checkpointing.py)
AUTO_INTERVAL = "auto"
# DeepSpeed's batch keys, which the batch check refuses in this order: the micro-batch, then what follows from it
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def _require_int(ds: dict[str, Any], key: str, minimum: int = 1, section: str = "") -> int | None:
    value = ds.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ConfigError(f"{section}{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def check_deepspeed(ds: dict[str, Any], cfg: ModelConfig, world_size: int | None) -> None:
    """The DeepSpeed keys a pipeline run depends on, checked the way the engine would fail on them.
    world_size None: not launched (e.g. planning); assume one pipeline replica."""
    for key in BATCH_KEYS:
        _require_int(ds, key)  # before DeepSpeed's own check, whose message names only the product
    check_deepspeed_keys(ds, OUR_SECTIONS)
    check_sections(ds, engine_config)
    check_monitors(ds)
    stages, interval = check_pipeline_section(ds, cfg)
    _require_int(ds, "steps_per_print")
    clipping = ds.get("gradient_clipping", 0)  # left out: DeepSpeed's 1.0 (deepspeed_settings.py), which passes
    if isinstance(clipping, bool) or not isinstance(clipping, int | float) or clipping < 0:
        raise ConfigError(f"gradient_clipping: expected a number >= 0 (0: no clipping), got {clipping!r}")
    # DeepSpeed's reentrant checkpoint (its default) breaks when a checkpointed decoder layer sends two
    # float tensors (decoder state and encoder_out) across a stage boundary: its backward runs twice.
    if engine_config(ds)["pipeline"]["use_reentrant"] and (interval == AUTO_INTERVAL or interval > 0):
        raise ConfigError(
            "pipeline.use_reentrant: reentrant activation checkpointing fails when decoder activations cross "
            "a stage boundary; set it false (fathom's default: pipeline/config/engine_defaults.py)"
        )
    if (zero_stage := zero_optimization_stage(ds)) not in (0, 1):
        raise ConfigError(
            f"zero_optimization.stage: {zero_stage} is not supported by DeepSpeed's pipeline engine; use 0 or 1"
        )
    check_batch_sizes(ds, stages, stages if world_size is None else world_size)
    check_precision(ds, zero_stage)


def check_pipeline_section(ds: dict[str, Any], cfg: ModelConfig) -> tuple[int, int | str]:
    """The pipeline section's keys and values; returns its stages and checkpoint interval."""
    pipeline = ds.get("pipeline")
    if not isinstance(pipeline, dict) or "stages" not in pipeline:
        raise ConfigError('pipeline.stages: missing; add "pipeline": {"stages": S} with S pipeline stages')
    known = pipeline_defaults()
    for key, value in pipeline.items():
        if key not in known:
            raise unknown_key_error(f"pipeline.{key}", known)
        # DeepSpeed's switches and counts; fathom checks the rest
        if isinstance(known[key], bool | int) and key != CHECKPOINT_INTERVAL:
            check_value(value, type(known[key]), f"pipeline.{key}")
    stages = _require_int(pipeline, "stages", section="pipeline.")
    layers = cfg.encoder_layers + cfg.decoder_layers
    if stages > layers:
        raise ConfigError(
            f"pipeline.stages: {stages} stages for {layers} Transformer layers; use at most {layers} stages"
        )
    partition_pattern(pipeline.get("partition", DEFAULT_PARTITION))
    interval = pipeline.get(CHECKPOINT_INTERVAL, 0)
    if interval != AUTO_INTERVAL and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 0):
        raise ConfigError(
            f"pipeline.{CHECKPOINT_INTERVAL}: expected an integer >= 0 (0: no checkpointing) or "
            f'"{AUTO_INTERVAL}" (the least recomputation that fits the memory), got {interval!r}'
        )
    return stages, interval


def check_batch_sizes(ds: dict[str, Any], stages: int, world_size: int) -> None:
    """The batch keys against the launch's processes: stages x data-parallel replicas."""
    if world_size % stages:
        raise ConfigError(
            f"pipeline.stages: {world_size} processes cannot be split into {stages} stages; "
            f"launch a multiple of {stages} processes"
        )
    data_parallel = world_size // stages
    micro = _require_int(ds, "train_micro_batch_size_per_gpu")
    if micro is None:
        raise ConfigError("train_micro_batch_size_per_gpu: missing; set the sentences per micro-batch")
    total = _require_int(ds, "train_batch_size")
    accumulation = _require_int(ds, "gradient_accumulation_steps")
    if total is not None and accumulation is not None and total != micro * accumulation * data_parallel:
        keep = total // (micro * data_parallel)
        same_batch = (
            f"gradient_accumulation_steps to {keep} to keep {total} a step, or "
            if keep and keep * micro * data_parallel == total
            else ""
        )
        raise ConfigError(
            f"train_batch_size: {total} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
            f"{accumulation} x {data_parallel} data-parallel ranks; set {same_batch}train_batch_size to "
            f"{micro * accumulation * data_parallel}"
        )
    if total is not None and total % (micro * data_parallel):
        raise ConfigError(
            f"train_batch_size: {total} is not a multiple of train_micro_batch_size_per_gpu {micro} x "
            f"{data_parallel} data-parallel ranks"
        )


def check_precision(ds: dict[str, Any], zero_stage: int) -> None:
    """fp16 and bf16: at most one, and each only where DeepSpeed trains and resumes it correctly."""
    for section in ("fp16", "bf16"):
        if not isinstance(ds.get(section, {}), dict):
            raise ConfigError(f'{section}: expected an object like {{"enabled": true}}')
    if ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled"):
        raise ConfigError("fp16 and bf16 are both enabled; enable at most one")
    # DeepSpeed 0.19.8's engine.backward scales the loss only for ZeRO optimizers, while the fp16 optimizer
    # without ZeRO divides every gradient by the loss scale (deepspeedai/DeepSpeed#8393): updates come out
    # scale times too small and overflows go unseen. Seen on an H200: 2^24 and 2^28 gave the same losses.
    if precision(ds) == "fp16" and zero_stage == 0:
        raise ConfigError(
            "fp16.enabled: DeepSpeed never scales the loss for fp16 without ZeRO; set zero_optimization.stage to 1"
        )
    if precision(ds) == "fp16" and not torch.cuda.is_available():
        raise ConfigError("fp16.enabled: fp16 training needs a GPU; on CPU use bf16 or fp32")
    # DeepSpeed 0.19.8 saves this mode's optimizer state (BF16_Optimizer, which still shards its fp32
    # master weights over data-parallel ranks) from data-parallel rank 0 only, as one dict, then its own
    # load_state_dict indexes it as a per-rank list: such a run trains but can never resume (KeyError 0).
    if precision(ds) == "bf16" and zero_stage == 0:
        raise ConfigError(
            "bf16.enabled: DeepSpeed cannot resume bf16 checkpoints without ZeRO; set zero_optimization.stage to 1"
        )


def precision(ds: dict[str, Any]) -> str:
    """The run's precision by DeepSpeed's section names: bf16, fp16 or fp32 (neither enabled)."""
    return next((name for name in ("bf16", "fp16") if ds.get(name, {}).get("enabled")), "fp32")


def zero_optimization_stage(ds: dict[str, Any]) -> int:
    return ds.get("zero_optimization", {}).get("stage", 0)


def gradients_all_reduced(data_parallel: int) -> bool:
    """Whether a step flattens the gradients and all-reduces them: only across data-parallel replicas. On
    one, at ZeRO-0 and ZeRO-1 alike, fathom skips DeepSpeed's all-reduce of the gradients with themselves
    (pipeline/engine/internals.py's set_self_reduction)."""
    return data_parallel > 1


def precision_warning(ds: dict[str, Any]) -> str | None:
    """A line for the start of a run whose precision will crawl on this machine, else None."""
    if precision(ds) == "bf16" and not torch.cuda.is_available() and not native_bf16_cpu():
        return (
            "bf16.enabled on a CPU without avx512_bf16 or amx_bf16: torch emulates bf16 matrix products here, "
            "about 50x slower than fp32; train in fp32 (bf16.enabled=false) on this machine"
        )
    return None


MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def check_monitors(ds: dict[str, Any]) -> None:
    """DeepSpeed's monitors import their package and make their output_path on every rank at start-up:
    a missing package or a path that cannot be made was a traceback per rank."""
    from deepspeed.monitor.config import get_monitor_config

    monitors = get_monitor_config(ds)
    for section, package in MONITOR_PACKAGES.items():
        if getattr(monitors, section).enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{section}.enabled: needs the {package} package; pip install {package}, or disable it")
    for section in ("tensorboard", "csv_monitor"):
        monitor = getattr(monitors, section)
        if monitor.enabled and monitor.output_path:
            check_makeable(Path(monitor.output_path), f"{section}.output_path")


def check_schedule(ds: dict[str, Any], max_steps: int) -> None:
    """A schedule with an end (WarmupDecayLR, WarmupCosineLR) that ends before the run does would train
    the remaining steps at its final rate (0 for WarmupDecayLR by default), and one that ends inside its
    warmup never decays as written; DeepSpeed only logs a warning for the second."""
    from deepspeed.runtime import lr_schedules

    scheduler = ds.get("scheduler", {})
    total = scheduler.get("params", {}).get("total_num_steps")
    if total is None:
        return
    default = inspect.signature(getattr(lr_schedules, scheduler["type"])).parameters["warmup_num_steps"].default
    warmup = scheduler["params"].get("warmup_num_steps", default)
    if total < warmup:
        raise ConfigError(
            f"scheduler.params.total_num_steps: {total} ends inside the warmup of {warmup} steps; set it to "
            f"{max(warmup, max_steps)} or more"
        )
    if total < max_steps:
        raise ConfigError(
            f"scheduler.params.total_num_steps: {total} ends before train.max_steps {max_steps}, and the steps "
            f"after it would train at the schedule's final rate; set it to {max_steps}"
        )


def partition_pattern(partition: Any) -> re.Pattern | None:
    """cost, uniform or parameters (None), or type:REGEX (its pattern, compiled as DeepSpeed matches it
    against the layers' class names; pipeline/parts/specs.py checks that it matches one)."""
    if partition in ("cost", "uniform", "parameters"):
        return None
    if not isinstance(partition, str) or not partition.startswith("type:"):
        raise ConfigError(f"pipeline.partition: {partition!r}; use cost, uniform, parameters or type:REGEX")
    try:
        return re.compile(partition[len("type:") :], re.IGNORECASE)
    except re.error as err:
        raise ConfigError(f"pipeline.partition: {partition!r} is not a regular expression ({err})") from None


def accumulation(ds: Mapping[str, Any], replicas: int) -> int:
    """Micro-batches each replica accumulates per step, as DeepSpeed derives it when not given; `ds` a run's
    DeepSpeed config, or the one a checkpoint saved (DeepSpeedSettings.accumulation reads a run's)."""
    if (given := ds.get("gradient_accumulation_steps")) is not None:
        return given
    if (total := ds.get("train_batch_size")) is not None:
        return total // (ds["train_micro_batch_size_per_gpu"] * replicas)
    return 1
