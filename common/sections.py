"""Typed configuration sections with strict, user-facing validation.

DeepSpeed silently ignores keys it does not know, so every section of ours (the model's, the run's, a
study's) is checked here: an unknown key or a value of the wrong type is a one-line `ConfigError`
naming the dotted key. A `Literal` type is a choice, checked here rather than by hand in each section.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from common.errors import ConfigError, unknown_key_error

T = TypeVar("T")
# Field metadata of a setting that acts only when a run starts (on its first weights): a resume that
# changed it would silently ignore it, so resuming refuses the change (pipeline/checkpoint/saving.py).
START_ONLY = {"start_only": True}


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
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return value


def parse_section(cls: type[T], data: Any, where: str) -> T:
    """Builds dataclass `cls` from a JSON object, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise unknown_key_error(f"{where}.{key}", names)
    values = {key: check_value(value, hints[key], f"{where}.{key}") for key, value in data.items()}
    return cls(**values)


def start_only(cls: type, where: str) -> list[str]:
    """The dotted keys of section `cls` (read at `where`) whose fields are declared START_ONLY."""
    return [f"{where}.{f.name}" for f in dataclasses.fields(cls) if f.metadata.get("start_only")]
