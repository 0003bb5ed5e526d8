"""Reading DeepSpeed pipeline checkpoints back into the single-process Transformer.

A pipeline checkpoint holds one file per layer with parameters, named by the layer's index in
the spec list (layer_07-..., layer_123-...; parameter-free and tied re-uses have none). The
spec list says which module of the reference model each file belongs to.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model.config import ConfigError, ModelConfig
from model.transformer import Transformer
from pipeline.hooks import ScheduleHook
from pipeline.layers import layer_specs

CONFIG_FILE = "config.json"


def model_config(save_dir: str | Path) -> ModelConfig:
    path = Path(save_dir) / CONFIG_FILE
    if not path.exists():
        raise ConfigError(f"{save_dir}: not a training directory (no {CONFIG_FILE}); pass train.save_dir of a run")
    return ModelConfig.from_dict(json.loads(path.read_text())["model"])


def checkpoint_dir(save_dir: str | Path, tag: str | None = None) -> Path:
    save_dir = Path(save_dir)
    if tag is None:
        latest = save_dir / "latest"
        if not latest.exists():
            raise ConfigError(f"{save_dir}: no 'latest' file; pass a tag (one of the global_step* folders)")
        tag = latest.read_text().strip()
    path = save_dir / tag
    if not path.is_dir():
        raise ConfigError(f"{save_dir}: no checkpoint tagged '{tag}'")
    return path


def layer_file(checkpoint: Path, index: int) -> Path:
    return checkpoint / f"layer_{index:02d}-model_states.pt"


def global_step(checkpoint: Path) -> int:
    """The optimizer steps a checkpoint had taken (DeepSpeed keeps them in the model-states file)."""
    states = torch.load(checkpoint / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    return int(states["global_steps"])


def load_reference(save_dir: str | Path, tag: str | None = None) -> Transformer:
    """The single-process model with the weights of a pipeline checkpoint of any depth and stage count,
    and its step-dependent values (BranchNorm's alpha) at the checkpoint's step."""
    cfg = model_config(save_dir)
    checkpoint = checkpoint_dir(save_dir, tag)
    model = Transformer(cfg)
    for index, (name, _) in enumerate(layer_specs(cfg)):
        if name is None:
            continue
        state = torch.load(layer_file(checkpoint, index), map_location="cpu", weights_only=True)
        model.get_submodule(name).load_state_dict(state)
    ScheduleHook(model)(global_step(checkpoint))
    return model.eval()
