"""The docs agree with the code: docs/TRAINING.md's table of config keys names every key of the model,
data and train sections, and only keys that exist, and its table of DeepSpeed's sections every key fathom
applies or refuses, and the config mistakes it quotes are the code's lines (docs/SCHEMES.md's table is checked
in test_cli.py)."""

import dataclasses
import re
import typing

import pytest

from fathom.common.errors import ConfigError
from fathom.model.model_config import ModelConfig
from fathom.pipeline.config.deepspeed_sections import APPLIED, REFUSED
from fathom.pipeline.config.engine_defaults import ENGINE_DEFAULTS
from fathom.pipeline.config.run_config import DataConfig, TrainConfig, load_config
from tests.helpers import ROOT

SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
PLACEHOLDER = "<"  # model.<scheme>.<option>: the schemes' options, which docs/SCHEMES.md lists


def documented_keys() -> set[str]:
    """Every key in the first column of TRAINING.md's config table, `a.{b,c}` spelled out."""
    keys = set()
    for line in (ROOT / "docs" / "TRAINING.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        for key in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if match := re.fullmatch(r"(.*)\{(.*)\}", key):
                keys |= {match[1] + part for part in match[2].split(",")}
            elif key.split(".")[0] in SECTIONS:
                keys.add(key)
    return keys


def nested(cls: type) -> type | None:
    """The dataclass a field of type `cls` holds, if any (`X`, `X | None`)."""
    for candidate in (cls, *typing.get_args(cls)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def key_exists(key: str) -> bool:
    section, *path = key.split(".")
    cls = SECTIONS[section]
    for name in path:
        if cls is None:
            return False
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if name not in fields:
            return False
        cls = nested(typing.get_type_hints(cls)[name])
    return True


def test_the_config_table_names_every_key_and_only_real_ones():
    documented = documented_keys()
    fields = [f"{section}.{field.name}" for section, cls in SECTIONS.items() for field in dataclasses.fields(cls)]
    # model.schemes is documented as model.<scheme>.<option>; a nested section may be listed key by key
    missing = [
        name
        for name in fields
        if name != "model.schemes" and not any(key == name or key.startswith(name + ".") for key in documented)
    ]
    assert missing == [], f"docs/TRAINING.md's config table lacks {missing}"
    unknown = sorted(key for key in documented if PLACEHOLDER not in key and not key_exists(key))
    assert unknown == [], f"docs/TRAINING.md's config table names keys no section has: {unknown}"


def test_a_nested_sections_row_names_each_of_its_keys():
    """A nested section documented in one row (train.valid_bleu, whose keys are model.search.SearchConfig's
    and `sentences`) names every key it has, so a new search setting cannot go undocumented."""
    rows = {}
    for line in (ROOT / "docs" / "TRAINING.md").read_text().splitlines():
        if line.startswith("| `"):
            rows[re.findall(r"`([^`]+)`", line.split(" | ")[0])[0]] = line
    checked = 0
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            inner, key = nested(hints[field.name]), f"{section}.{field.name}"
            if inner is None or key not in rows:
                continue
            checked += 1
            missing = [f.name for f in dataclasses.fields(inner) if f"`{f.name}`" not in rows[key]]
            assert missing == [], f"docs/TRAINING.md's row for {key} does not name {missing}"
    assert checked, "no nested section is documented in one row"


def test_the_deepspeed_table_names_each_key_as_applied_or_refused():
    """Each DeepSpeed key pipeline/config/deepspeed_sections.py decides has a row of docs/TRAINING.md's
    table of DeepSpeed's sections, which says "refused" exactly for the refused ones."""
    text = (ROOT / "docs" / "TRAINING.md").read_text()
    table = text[text.index("### DeepSpeed's sections in fathom's engine") :]
    rows = {}
    for line in table[table.index("| key |") :].split("\n\n")[0].splitlines()[2:]:
        first, what = line.split(" | ", 1)
        rows.update(dict.fromkeys(re.findall(r"`([^`]+)`", first), what))
    decided = APPLIED.keys() | REFUSED.keys()
    assert sorted(decided - rows.keys()) == []
    assert sorted(key for key in decided if rows[key].startswith("refused") != (key in REFUSED)) == []


# The override that makes each config mistake docs/TRAINING.md quotes, on ds_configs/default.json
QUOTED_MISTAKES = [
    ("model.encoder_layer=3", 2),
    ("modle.x=1", 2),
    ("optimizer.params.lrr=1", 2),
    ("pipeline.stages=30", 30),
    ("zero_optimization.stage=2", 2),
    ("train_batch_size=30 pipeline.stages=1", 1),
    ('zero_optimization.stage="1"', 2),
]


def test_the_config_mistakes_training_md_quotes_are_the_codes_lines():
    text = (ROOT / "docs" / "TRAINING.md").read_text()
    config_mistake = r"^fathom: error: [a-z_]+[.:].*$"  # a key's line, not a rank's or a step's
    quoted = [line.removeprefix("fathom: error: ") for line in re.findall(config_mistake, text, re.M)]
    produced = []
    for overrides, world_size in QUOTED_MISTAKES:
        with pytest.raises(ConfigError) as refused:
            load_config(str(ROOT / "ds_configs" / "default.json"), overrides.split(), world_size=world_size)
        produced.append(str(refused.value))
    assert [line for line in quoted if line in produced] == produced


def test_the_engine_settings_section_names_every_engine_default():
    """Each key fathom sets in DeepSpeed's config (pipeline/config/engine_defaults.py) is explained in
    docs/TRAINING.md's "Settings fathom picks for the engine"."""
    text = (ROOT / "docs" / "TRAINING.md").read_text()
    section = text[text.index("## Settings fathom picks for the engine") :].split("\n## ")[0]
    assert [d.key for d in ENGINE_DEFAULTS if f"`{d.key}`" not in section] == []
