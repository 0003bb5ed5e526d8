"""Typed configuration sections with strict, user-facing validation, and what a resume does with each.

DeepSpeed silently ignores keys it does not know, so every section of ours (the model's, the run's, a
study's) is checked here: an unknown key or a value of the wrong type is a one-line `ConfigError`
naming the dotted key. A `Literal` type is a choice, checked here rather than by hand in each section.
A field declares in its metadata what --resume does with a change to it (OnResume) and, if it is a number,
its bounds (`bounds`), which parse_section enforces with the dotted key it was given.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, TypeVar

from fathom.common.errors import ConfigError, check_number, unknown_key_error

T = TypeVar("T")


class OnResume(enum.Enum):
    """What --resume does with a setting changed since the checkpoint it resumes. Every field of a config
    section declares it, in the field's metadata (`field(..., metadata=APPLIED)`): the one place it is
    decided, which the resume checks, the data order and the change report read (a field holding a
    section declares it for all of that section's keys). tests/test_config.py fails for a field without."""

    APPLIED = "applies from the first resumed step; the launch prints the change"
    LOCATION = "where the run lives, not how it trains: no change of the run"
    WEIGHTS = "the weights' shapes follow it: refused, as train.init_from's weights of another value are"
    OPTIMIZER_STATE = "the form of the saved optimizer state follows it: refused"
    START_ONLY = "acts only when a run starts (on its first weights): refused"
    DATA_ORDER = "decides which pairs each micro-batch holds: refused, or see train.on_data_change"


def on_resume(rule: OnResume) -> dict[str, OnResume]:
    """A field's metadata declaring what --resume does with a change to it."""
    return {"on_resume": rule}


APPLIED = on_resume(OnResume.APPLIED)
LOCATION = on_resume(OnResume.LOCATION)
WEIGHTS = on_resume(OnResume.WEIGHTS)
START_ONLY = on_resume(OnResume.START_ONLY)
DATA_ORDER = on_resume(OnResume.DATA_ORDER)


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A number's allowed range, [least, most] or [least, below), and what its edge means in the error."""

    least: float
    most: float | None = None
    below: float | None = None
    what: str = ""

    def check(self, key: str, value: float | list[float] | None) -> None:
        """`value` (each item of a list) within the range, or a ConfigError naming `key`."""
        for item_key, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            shown = key if item_key is None else f"{key}[{item_key}]"
            check_number(shown, item, self.least, self.most, self.what, self.below)


def bounds(least: float, most: float | None = None, *, below: float | None = None, what: str = "") -> dict:
    """A numeric field's metadata declaring its range (of each item, for a list), e.g.
    `field(default=0.1, metadata=APPLIED | bounds(0, below=1))`."""
    return {"bounds": Bounds(least, most, below, what)}


def check_field(setting: dataclasses.Field, value: Any, key: str) -> None:
    """`value` of `setting` within the bounds its metadata declares (if any), or a ConfigError naming `key`."""
    if (declared := setting.metadata.get("bounds")) is not None:
        declared.check(key, value)


def check_fields(section: Any, where: str) -> None:
    """Every field of dataclass instance `section` (one built in Python, not parsed) within its bounds, named
    `where.field` in the error."""
    for setting in dataclasses.fields(section):
        check_field(setting, getattr(section, setting.name), f"{where}.{setting.name}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def check_value(value: Any, tp: Any, key: str) -> Any:
    """`value` as type `tp` (a dataclass, a Literal choice, ...), or a ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return check_value(value, option, key)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if origin is typing.Literal:  # a choice: the type names every allowed value
        choices = typing.get_args(tp)
        if not any(value == choice and type(value) is type(choice) for choice in choices):
            raise ConfigError(f"{key}: {value!r}; choose one of {', '.join(map(str, choices))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object, got {value!r}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [check_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return parse_section(tp, value, key)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        # JSON's 5e8 is a float to every parser: name the integer to write instead
        written = f" (write {int(value)})" if isinstance(value, float) and value.is_integer() else ""
        raise ConfigError(f"{key}: expected an integer, got {value!r}{written}")
    if not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return value


def parse_section(cls: type[T], data: Any, where: str) -> T:
    """Builds dataclass `cls` from a JSON object, rejecting unknown keys, wrong types and numbers out of the
    bounds a field declares, each in one line naming the dotted key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise unknown_key_error(f"{where}.{key}", names)
    values = {key: check_value(value, hints[key], f"{where}.{key}") for key, value in data.items()}
    for setting in dataclasses.fields(cls):
        if setting.name in values:
            check_field(setting, values[setting.name], f"{where}.{setting.name}")
    return cls(**values)


def resume_rule(field: dataclasses.Field) -> OnResume | None:
    """What --resume does with a change to `field`, as it declares it (None: undeclared)."""
    return field.metadata.get("on_resume")


def resume_rules(cls: type, where: str) -> dict[str, OnResume]:
    """Each declared field of section `cls` (read at `where`) by dotted key, and its OnResume."""
    return {f"{where}.{f.name}": rule for f in dataclasses.fields(cls) if (rule := resume_rule(f)) is not None}
