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
from pipeline.corpus import BinarizedCorpus
from pipeline.hooks import ScheduleHook
from pipeline.layers import layer_specs

CONFIG_FILE = "config.json"


def model_config(save_dir: str | Path) -> ModelConfig:
    path = Path(save_dir) / CONFIG_FILE
    if not path.exists():
        raise ConfigError(f"{save_dir}: not a training directory (no {CONFIG_FILE}); pass train.save_dir of a run")
    return ModelConfig.from_dict(json.loads(path.read_text())["model"])


def check_vocab(cfg: ModelConfig, corpus: BinarizedCorpus, data: str | Path) -> None:
    """Fails unless the data directory's dictionaries fit the model's embeddings."""
    if (cfg.src_vocab_size, cfg.tgt_vocab_size) != (corpus.src_vocab_size, corpus.tgt_vocab_size):
        raise ConfigError(
            f"{data}: dictionaries have {corpus.src_vocab_size}/{corpus.tgt_vocab_size} entries but the model was "
            f"trained with {cfg.src_vocab_size}/{cfg.tgt_vocab_size}; use the run's data directory"
        )


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


def missing_layer_files(cfg: ModelConfig, checkpoint: Path) -> None:
    """Fails on a checkpoint without a file for every layer that has parameters."""
    names = [layer_file(checkpoint, i).name for i, (name, _) in enumerate(layer_specs(cfg)) if name is not None]
    if missing := [name for name in names if not (checkpoint / name).exists()]:
        raise ConfigError(
            f"{checkpoint}: {len(missing)} of {len(names)} layer files missing (first {missing[0]}); "
            "the checkpoint is incomplete or from another model"
        )


def global_step(checkpoint: Path) -> int:
    """The optimizer steps a checkpoint had taken (DeepSpeed keeps them in the model-states file;
    weights converted from fairseq have none: step 0)."""
    path = checkpoint / "mp_rank_00_model_states.pt"
    if not path.exists():
        return 0
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_steps"])


# What must agree for one model's weights to load into another.
SHAPE_KEYS = (
    "encoder_layers",
    "decoder_layers",
    "embed_dim",
    "ffn_dim",
    "attention_heads",
    "src_vocab_size",
    "tgt_vocab_size",
    "share_all_embeddings",
    "share_decoder_input_output_embed",
    "learned_pos",
    "norm_scheme",
)


def check_init_from(save_dir: str | Path, cfg: ModelConfig) -> Path:
    """The checkpoint train.init_from names, checked against the run's model; fails in one line."""
    source = model_config(save_dir)
    for key in SHAPE_KEYS:
        if getattr(source, key) != getattr(cfg, key):
            raise ConfigError(
                f"train.init_from: model.{key} is {getattr(source, key)} in {save_dir} but {getattr(cfg, key)} "
                "here; the model section must describe the same model"
            )
    checkpoint = checkpoint_dir(save_dir)
    missing_layer_files(cfg, checkpoint)
    return checkpoint


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
