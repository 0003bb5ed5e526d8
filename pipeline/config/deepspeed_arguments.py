"""The optimizer's and the scheduler's arguments in a DeepSpeed config, compared before launch with the
signatures of the classes the pinned DeepSpeed will build from them: an unknown argument, or a value of
another type than the argument's default, is one line naming it (DeepSpeed would fail inside the engine
on every rank, or compute with a string)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from fathom.common.errors import ConfigError, closest
from fathom.pipeline.config import inverse_sqrt


def parameters(*builders: Callable) -> set[str]:
    """Keyword arguments the constructors accept, besides what DeepSpeed passes itself."""
    names = set()
    for builder in builders:
        names.update(inspect.signature(builder).parameters)
    return names - {"self", "params", "optimizer", "args", "kwargs"}


def check_constructor_args(ds: dict[str, Any]) -> None:
    """optimizer.params and scheduler.params become keyword arguments of the classes DeepSpeed builds:
    one it does not take is a TypeError on every rank at launch."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import ADAM_OPTIMIZER, ADAMW_OPTIMIZER, DEEPSPEED_OPTIMIZERS, TORCH_ADAM_PARAM

    optimizer = ds.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("type"), str):
        name = optimizer["type"]
        accepted: set[str] | None = None
        if name.lower() in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
            # which class depends on torch_adam and offloading (deepspeed/runtime/engine.py); any of them
            accepted = parameters(torch.optim.Adam, torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam)
            accepted |= {TORCH_ADAM_PARAM, "adam_w_mode", "fp32_optimizer_states"}
        elif name.lower() not in DEEPSPEED_OPTIMIZERS:
            builder = getattr(torch.optim, name, None)
            if not inspect.isclass(builder) or not issubclass(builder, torch.optim.Optimizer):
                known = {ADAM_OPTIMIZER.capitalize(), "AdamW", *DEEPSPEED_OPTIMIZERS}
                raise ConfigError(f"optimizer.type: {name!r} is neither DeepSpeed's nor torch's{closest(name, known)}")
            accepted = parameters(builder)
        params = optimizer.get("params", {})
        check_arguments("optimizer", name, params, accepted)
        if name.lower() in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):  # their values mean what torch's Adam's do
            check_values("optimizer", torch.optim.AdamW, params)
        elif name.lower() not in DEEPSPEED_OPTIMIZERS:
            check_values("optimizer", getattr(torch.optim, name), params)
    scheduler = ds.get("scheduler")
    if isinstance(scheduler, dict):
        name = scheduler.get("type")
        known = (*lr_schedules.VALID_LR_SCHEDULES, inverse_sqrt.NAME)
        if name not in known:
            raise ConfigError(
                f"scheduler.type: {name!r} is neither DeepSpeed's scheduler nor fathom's; use one of {', '.join(known)}"
            )
        if "params" not in scheduler:
            raise ConfigError(
                'scheduler.params: missing; give the scheduler\'s arguments, e.g. {"warmup_num_steps": 1000}'
            )
        builder = inverse_sqrt.InverseSqrtLR if name == inverse_sqrt.NAME else getattr(lr_schedules, name)
        check_arguments("scheduler", name, scheduler["params"], parameters(builder))
        check_scheduler_rates(scheduler["params"])
        warmup = scheduler["params"].get(lr_schedules.WARMUP_TYPE)
        rates = sorted({lr_schedules.WARMUP_LINEAR_RATE, lr_schedules.WARMUP_LOG_RATE})
        if warmup is not None and warmup not in rates:  # DeepSpeed would warn and warm up by log instead
            raise ConfigError(f"scheduler.params.warmup_type: {warmup!r}; choose one of {', '.join(rates)}")
        check_values("scheduler", builder, scheduler["params"])


def check_arguments(section: str, name: str, params: Any, accepted: set[str] | None) -> None:
    if not isinstance(params, dict):
        raise ConfigError(f"{section}.params: expected an object of arguments, got {params!r}")
    for key in params:
        if accepted is not None and key not in accepted:
            raise ConfigError(f"{section}.params.{key}: not an argument of {name}{closest(key, accepted)}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# A scheduler's arguments that are rates or momenta, by DeepSpeed's names (warmup_min_lr, cycle_max_lr,
# decay_lr_rate, lr_range_test_step_rate, warmup_min_ratio, cos_min_ratio, cycle_min_mom, ...): the learning
# rate the schedule sets is made of them, and none of its constructors refuses one below 0.
RATE_SUFFIXES = ("_lr", "_rate", "_ratio", "_mom")


def check_scheduler_rates(params: dict[str, Any]) -> None:
    """A negative rate trains by gradient ascent: torch refuses optimizer.params.lr=-0.001, but a
    scheduler overwrites the optimizer's rate unchecked. Values of another type are left to
    check_like_defaults, which names the type expected."""
    for key, value in params.items():
        values = value if isinstance(value, list) else [value]  # a rate per parameter group, as DeepSpeed takes
        if key.endswith(RATE_SUFFIXES) and any(is_number(v) and v < 0 for v in values):
            raise ConfigError(
                f"scheduler.params.{key}: {value!r} is negative, and a learning rate below 0 trains by "
                "gradient ascent; give a value >= 0"
            )


def check_like_defaults(section: str, builder: Callable, params: dict[str, Any]) -> None:
    """A value where the constructor's default is a number, or a pair of numbers (Adam's betas), must be
    one too: a string such as "nan" from --override would otherwise fail inside arithmetic."""
    signature = inspect.signature(builder).parameters
    for key, value in params.items():
        default, annotation = signature[key].default, signature[key].annotation
        if value is None and default is None:  # "use the default": WarmupLR's warmup_max_lr is the optimizer's lr
            continue
        if (is_number(default) or annotation in (int, float, "int", "float")) and not is_number(value):
            raise ConfigError(f"{section}.params.{key}: expected a number, got {value!r}")
        if isinstance(default, tuple) and all(map(is_number, default)):
            if not (isinstance(value, list) and len(value) == len(default) and all(map(is_number, value))):
                raise ConfigError(
                    f"{section}.params.{key}: expected {len(default)} numbers, e.g. {list(default)}, got {value!r}"
                )


def check_values(section: str, builder: Callable, params: dict[str, Any]) -> None:
    """Builds the optimizer (on one dummy parameter) or the scheduler (of a dummy optimizer) with the
    arguments its constructor accepts, so its own checks of their values run now, not at launch."""
    from deepspeed.utils import logger

    accepted = {k: v for k, v in params.items() if k in parameters(builder)}
    check_like_defaults(section, builder, accepted)
    weight = torch.nn.Parameter(torch.zeros(1))
    level = logger.level
    logger.setLevel(logging.ERROR)  # a scheduler built outside an engine warns about its learning rate
    try:
        if inspect.isclass(builder) and issubclass(builder, torch.optim.Optimizer):
            builder([weight], **accepted)
        else:
            builder(torch.optim.SGD([weight], lr=0.0), **accepted)
    except Exception as err:  # noqa: BLE001 (the constructor's own refusal, as one line)
        reason = str(err).strip().split("\n")[0] or type(err).__name__
        raise ConfigError(f"{section}.params: {reason}") from None
    finally:
        logger.setLevel(level)
