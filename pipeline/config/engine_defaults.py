"""The one table of what fathom sets in DeepSpeed's config where a run's config leaves a key out, with
DeepSpeed 0.19.8's own value and why. `engine_config` applies it to the config DeepSpeed's engine receives
(each launch records that config as SAVE_DIR/deepspeed_config.json); config.json keeps what the run's
config says. The benchmarks' "DeepSpeed's own" runs put back DeepSpeed's values of the settings fathom picks
for speed (`deepspeeds_own`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fathom.pipeline.config import inverse_sqrt


def _always(ds: dict[str, Any]) -> bool:
    return True


def _zero1_without_overlap(ds: dict[str, Any]) -> bool:
    zero = ds.get("zero_optimization", {})
    return zero.get("stage", 0) == 1 and not zero.get("overlap_comm")


@dataclass(frozen=True)
class EngineDefault:
    key: str  # dotted, in DeepSpeed's config
    fathoms: Any
    deepspeeds: Any  # DeepSpeed 0.19.8's own default
    why: str
    for_speed: bool  # a setting fathom picks for host time, which trains the same (tests/test_engine_settings.py)
    applies: Callable[[dict[str, Any]], bool] = _always


ENGINE_DEFAULTS = (
    EngineDefault(
        "pipeline.use_reentrant",
        False,
        True,
        "picks the checkpoint function PipelineModule starts with, which fathom then replaces with its own "
        "(pipeline/engine/recompute.py: torch's reentrant checkpoint with reseeded dropout masks); false keeps "
        "DeepSpeed's reentrant function, whose backward ran twice when a checkpointed decoder layer sends two "
        "float tensors across a stage boundary, from being the one a run could ever fall back on",
        for_speed=False,
    ),
    EngineDefault(
        "zero_optimization.contiguous_gradients",
        False,
        True,
        "at ZeRO-1 without overlap_comm the gradient hooks only count, in Python, once per parameter tensor and "
        "micro-batch (4,212 calls a step at 25L-25L with 4 micro-batches); the step reads the gradients either way",
        for_speed=True,
        applies=_zero1_without_overlap,
    ),
    EngineDefault(
        "timers.throughput.enabled",
        False,
        True,
        "DeepSpeed's samples/s timer synchronizes the device at every micro-batch's forward and step, a stall per "
        "micro-batch on a GPU; fathom times steps itself",
        for_speed=True,
    ),
)


def _set(config: dict[str, Any], key: str, value: Any, replace: bool) -> None:
    *parents, name = key.split(".")
    node = config
    for parent in parents:
        node = node.setdefault(parent, {})
    if replace or name not in node:
        node[name] = value


def engine_config(ds: dict[str, Any]) -> dict[str, Any]:
    """The config DeepSpeed's engine receives: a copy of the run's with fathom's value of each setting of
    ENGINE_DEFAULTS that applies to it and that it leaves out, and without fathom's own scheduler, which
    the engine receives built (inverse_sqrt.client_scheduler)."""
    config = copy.deepcopy(ds)
    if inverse_sqrt.is_ours(config):
        del config["scheduler"]
    for default in ENGINE_DEFAULTS:
        if default.applies(ds):
            _set(config, default.key, default.fathoms, replace=False)
    return config


def deepspeeds_own(ds: dict[str, Any]) -> dict[str, Any]:
    """A copy of `ds` with DeepSpeed's own value of every setting fathom picks for speed."""
    config = copy.deepcopy(ds)
    for default in ENGINE_DEFAULTS:
        if default.for_speed:
            _set(config, default.key, default.deepspeeds, replace=True)
    return config
