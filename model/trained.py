"""A trained model from a run directory: its config, and its weights from a pipeline checkpoint of any
depth and stage count, read with torch alone into the single-process Transformer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from fathom.common.checkpoint_format import layer_file, load_file, schedule_step
from fathom.common.errors import ConfigError
from fathom.common.run_layout import CONFIG_FILE, checkpoint_dir
from fathom.common.sections import OnResume, resume_rule
from fathom.model.model_config import ModelConfig
from fathom.model.model_section import parse_model
from fathom.model.parts import fairseq_key, model_parts, saved_names
from fathom.model.schedule import ScheduleHook
from fathom.model.transformer import Transformer


def model_config(save_dir: str | Path) -> ModelConfig:
    path = Path(save_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{save_dir}: not a training directory (no {CONFIG_FILE}); pass train.save_dir of a run")
    try:
        return parse_model(json.loads(path.read_text())["model"])
    except (ValueError, KeyError, TypeError) as err:  # ConfigError is a ValueError: its line says more
        detail = err if isinstance(err, ConfigError) else f"not a run's config ({type(err).__name__}: {err})"
        raise ConfigError(f"{path}: {detail}; the run directory is damaged, restore config.json") from None


def saved_layers(cfg: ModelConfig) -> list[tuple[int, str]]:
    """(pipeline layer index, reference module name) of every layer file a checkpoint of this model has."""
    return [(index, name) for index, name in enumerate(saved_names(cfg)) if name is not None]


def missing_layer_files(cfg: ModelConfig, checkpoint: Path) -> None:
    """Fails on a checkpoint without a file for every layer that has parameters."""
    names = [layer_file(checkpoint, index).name for index, _ in saved_layers(cfg)]
    if missing := [name for name in names if not (checkpoint / name).exists()]:
        raise ConfigError(
            f"{checkpoint}: {len(missing)} of {len(names)} layer files missing (first {missing[0]}); "
            "the checkpoint is incomplete or from another model"
        )


def check_same_model(save_dir: str | Path, cfg: ModelConfig, option: str, fix: str) -> None:
    """Fails in one line unless the run in save_dir trained the model `cfg` describes: every key the
    weights' shapes follow (declared OnResume.WEIGHTS) agrees, for one model's weights to load into another."""
    source = model_config(save_dir)
    shapes = [f.name for f in dataclasses.fields(ModelConfig) if resume_rule(f) is OnResume.WEIGHTS]
    for key in shapes:
        if getattr(source, key) != getattr(cfg, key):
            raise ConfigError(
                f"{option}: model.{key} is {getattr(source, key)} in {save_dir} but {getattr(cfg, key)} here; {fix}"
            )


def check_init_from(save_dir: str | Path, cfg: ModelConfig) -> Path:
    """The checkpoint train.init_from names, checked against the run's model; fails in one line."""
    check_same_model(save_dir, cfg, "train.init_from", "the model section must describe the same model")
    checkpoint = checkpoint_dir(save_dir)
    missing_layer_files(cfg, checkpoint)
    return checkpoint


def load_reference(save_dir: str | Path, tag: str | None = None) -> Transformer:
    """The single-process model with the weights of a pipeline checkpoint of any depth and stage count,
    and its step-dependent values (BranchNorm's alpha) at the checkpoint's step."""
    cfg = model_config(save_dir)
    checkpoint = checkpoint_dir(save_dir, tag)
    model = Transformer(cfg)
    for index, name in saved_layers(cfg):
        state = load_file(layer_file(checkpoint, index))
        model.get_submodule(name).load_state_dict(state)
    ScheduleHook(model)(schedule_step(checkpoint))
    return model.eval()


def fairseq_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's whole state dict under fairseq's names, a shared table under each of its names as fairseq
    saves it (one tensor: torch.save writes it once)."""
    return {
        fairseq_key(part.name, key): value
        for part in model_parts(model.cfg)
        for key, value in model.get_submodule(part.name).state_dict().items()
    }
