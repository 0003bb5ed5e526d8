"""The config file of a run: found by name (the configs fathom ships, the papers' recipes) or by path, read as
JSON (a key twice in one object, NaN or a byte that is not UTF-8 is one line), and changed by the command
line's --override dotted.key=value."""

from __future__ import annotations

import json
import math
from importlib.resources import files
from pathlib import Path
from typing import Any

from fathom.common.errors import ConfigError


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: a key given twice in one object would silently keep the last value."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"key '{key}' appears twice in one object; keep one")
        seen[key] = value
    return seen


def parse_override(text: str) -> tuple[list[str], Any]:
    """'model.encoder_layers=24' -> (['model', 'encoder_layers'], 24); values are JSON, else strings."""
    key, sep, raw = text.partition("=")
    if not sep or not all(key.split(".")):
        raise ConfigError(f"--override {text!r}: expected dotted.key=value, e.g. model.encoder_layers=24")
    try:
        value = json.loads(raw, object_pairs_hook=unique_keys)
    except json.JSONDecodeError:
        value = raw
    except ConfigError as err:
        raise ConfigError(f"--override {text!r}: {err}") from None
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> None:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--override {text}: {'.'.join(path[: depth + 1])} is not a section")
            node = child
        node[path[-1]] = value


# The papers' recipes, one config per headline row of a table (docs/RECIPES.md)
PAPERS = "papers"


def config_file(name: str | Path) -> Path:
    """The config at `name`; where `name` is a bare name and no file of that name exists, the config fathom
    ships under it (`default` or `default.json`, or a paper's recipe: ds_configs/papers/), so that an
    installed fathom runs from any directory. A directory of that name is no config, so it does not hide the
    shipped one (a run's save_dir named `default`, say). A path (a / in it, or a leading ., which Path drops
    from ./default) is read as written: a typo in it must not train a shipped config instead."""
    path, text = Path(name), str(name)
    if "/" in text or text.startswith(".") or path.is_file():
        return path
    filename = path.name if path.suffix == ".json" else f"{path.name}.json"
    shipped = files("fathom.ds_configs")
    for folder in (shipped, shipped / PAPERS):
        if (folder / filename).is_file():
            return Path(str(folder / filename))
    return path


def shipped_configs(folder: str = "") -> list[str]:
    """The names of the training configs fathom ships in ds_configs/`folder` (its study specs left out)."""
    shipped = [p for p in (files("fathom.ds_configs") / folder).iterdir() if p.name.endswith(".json")]
    return sorted(p.name.removesuffix(".json") for p in shipped if "model" in json.loads(p.read_text()))


def read_json(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # -sig: editors on Windows start files with a BOM
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such config; give a config file or a shipped one by name: {', '.join(shipped_configs())}, "
            f"or one of the papers' recipes (docs/RECIPES.md)"
        ) from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); save the config as UTF-8") from None
    try:
        raw = json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a JSON object")
    return raw


def check_finite(node: Any, path: str = "") -> None:
    """NaN or infinity (JSON's NaN, Infinity) is no setting of fathom's or DeepSpeed's."""
    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{path}: {node} is not a finite number")
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in children:
        check_finite(value, f"{path}.{key}" if path else str(key))
