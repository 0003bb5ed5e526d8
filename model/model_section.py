"""The config's `model` section as a whole: ModelConfig's keys, and under each registered scheme's name that
scheme's options (`model.<scheme>.<option>`), read, written back and declared for --resume."""

from __future__ import annotations

import dataclasses
from typing import Any

from fathom.common.errors import ConfigError
from fathom.common.sections import OnResume, parse_section, resume_rules
from fathom.model.model_config import ModelConfig
from fathom.model.norms import SCHEMES, build_scheme


def parse_model(data: Any, where: str = "model") -> ModelConfig:
    """The `model` section: ModelConfig's keys, and under a registered scheme's name that scheme's
    options (`model.<scheme>.<option>`). The scheme and the options of every scheme the section names are
    checked now, before any process trains."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {data!r}")
    fields = {k: v for k, v in data.items() if k not in SCHEMES}
    schemes = {k: v for k, v in data.items() if k in SCHEMES}
    cfg = parse_section(ModelConfig, fields, where)
    cfg.schemes = {**cfg.schemes, **schemes}
    build_scheme(cfg)
    for name in schemes:
        SCHEMES[name](cfg)
    return cfg


def model_section(cfg: ModelConfig) -> dict[str, Any]:
    """The `model` section as a config file holds it, what parse_model reads back: ModelConfig's keys, and
    each scheme's options under the scheme's name."""
    section = dataclasses.asdict(cfg)
    section.update(section.pop("schemes"))
    return section


def scheme_option_rules() -> dict[str, OnResume]:
    """What --resume does with a change to each option of every registered scheme, by dotted key
    (model.<scheme>.<option>), as its Options field declares it."""
    return {
        key: rule
        for name, scheme in SCHEMES.items()
        for key, rule in resume_rules(scheme.Options, f"model.{name}").items()
    }


def scheme_options(cfg: ModelConfig) -> dict[str, Any]:
    """Every registered scheme's options as `cfg` sets them, its defaults where it does not, by dotted key:
    an option left out and one written with its default value are the same setting."""
    return {
        f"model.{name}.{key}": value
        for name, scheme in SCHEMES.items()
        for key, value in dataclasses.asdict(
            parse_section(scheme.Options, cfg.schemes.get(name, {}), f"model.{name}")
        ).items()
    }
