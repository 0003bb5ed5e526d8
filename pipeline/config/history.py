"""What a run was trained with, stretch by stretch: SAVE_DIR/config.json and SAVE_DIR/config_history.jsonl.

config.json is the config of the latest launch (readers take the run's model from it).
config_history.jsonl has one record per stretch of steps trained under one config,
`{"from_step": S, "config": {...}}`: a --resume that changes a setting (a learning rate raised, more
steps) starts a new stretch at the step it resumes from, so config.json never misstates the steps
before. Records of steps that a resume trains again are dropped, as metrics.jsonl drops theirs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fathom.common.files import write_atomic
from fathom.common.jsonl import read_jsonl
from fathom.common.run_layout import CONFIG_FILE, CONFIG_HISTORY
from fathom.common.sections import OnResume
from fathom.pipeline.config.resume_rules import flat, settings_with


def read_back(config: dict[str, Any]) -> dict[str, Any]:
    """A config as its JSON reads back (lists, not tuples), to compare with a saved one."""
    return json.loads(json.dumps(config))


def shown(settings: dict[str, Any], key: str) -> str:
    """A flat setting as a config spells it, or `unset`."""
    return json.dumps(settings[key]) if key in settings else "unset"


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """`key old -> new` for every setting that differs, in key order, but where the run lives (declared
    LOCATION): a run directory copied or moved elsewhere is the same run."""
    old, new, location = flat(before), flat(after), settings_with(OnResume.LOCATION)
    keys = sorted(key for key in old.keys() | new.keys() if key not in location and shown(old, key) != shown(new, key))
    return [f"{key} {shown(old, key)} -> {shown(new, key)}" for key in keys]


def config_at(save_dir: Path, step: int) -> dict[str, Any]:
    """The config a run trained its step `step` with: its stretch's, or config.json for a run from before
    the history and a directory written without one (an import, an average)."""
    history = save_dir / CONFIG_HISTORY
    records = read_jsonl(history) if history.exists() else []
    if not records:
        return json.loads((save_dir / CONFIG_FILE).read_text())
    return [record for record in records if record["from_step"] < step or record is records[0]][-1]["config"]


def record_config(save_dir: Path, config: dict[str, Any], step: int) -> list[str]:
    """Writes config.json and the history for a launch that trains from `step` on with `config`; returns
    the settings that changed against the stretch before (empty for a new run)."""
    config = read_back(config)
    history = save_dir / CONFIG_HISTORY
    records = read_jsonl(history) if history.exists() else []
    if not records and step > 0 and (save_dir / CONFIG_FILE).exists():  # a run from before the history
        records = [{"from_step": 0, "config": json.loads((save_dir / CONFIG_FILE).read_text())}]
    records = [record for record in records if record["from_step"] < step]
    before = records[-1]["config"] if records else None
    changed = [] if before is None else changes(before, config)
    if before is None or changed:
        records.append({"from_step": step, "config": config})
    write_atomic(history, "".join(json.dumps(record) + "\n" for record in records))
    write_atomic(save_dir / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return changed
