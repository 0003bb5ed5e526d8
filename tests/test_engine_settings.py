"""The settings fathom gives DeepSpeed's engine for speed (docs/TRAINING.md, "Settings fathom picks for the
engine") fill only what a config leaves out, and train exactly what DeepSpeed's own defaults train: the
same losses and weights, bit for bit, with dropout and activation checkpointing on."""

import itertools

import pytest
import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

from corpus.batches import DataPosition
from model.model_config import ModelConfig
from pipeline.config.deepspeed_values import engine_config
from pipeline.deepspeed_internals import set_checkpoint_function
from pipeline.dropout_masks import DropoutMasks
from tools.step_profile import deepspeeds_settings
from tools.training_speed import built_engine, synthetic_batch


def test_defaults_fill_only_what_the_config_leaves_out():
    ds = {"zero_optimization": {"stage": 1}, "pipeline": {"stages": 1}}
    assert engine_config(ds) == {
        "zero_optimization": {"stage": 1, "contiguous_gradients": False},
        "pipeline": {"stages": 1},
        "timers": {"throughput": {"enabled": False}},
    }
    assert ds == {"zero_optimization": {"stage": 1}, "pipeline": {"stages": 1}}  # the run's own config untouched
    chosen = {
        "zero_optimization": {"stage": 1, "contiguous_gradients": True},
        "timers": {"throughput": {"enabled": True}},
    }
    assert engine_config(chosen) == chosen
    # overlap_comm stages gradients in the hooks' buckets; ZeRO-0 has no such hooks
    assert (
        "contiguous_gradients"
        not in engine_config({"zero_optimization": {"stage": 1, "overlap_comm": True}})["zero_optimization"]
    )
    assert "contiguous_gradients" not in engine_config({})["zero_optimization"]


def trained(cfg: ModelConfig, deepspeeds_defaults: bool, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    """Losses and final weights of `steps` steps on one engine, 2 micro-batches a step, every layer
    checkpointed, with fathom's dropout reseeding (as scripts/train.py runs it)."""
    ds = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
        "pipeline": {"stages": 1, "activation_checkpoint_interval": 1, "use_reentrant": False},
    }  # fmt: skip
    if deepspeeds_defaults:
        ds = deepspeeds_settings(ds)
    with built_engine(cfg, ds, "cpu") as engine:
        masks = DropoutMasks(engine, seed=1, position=DataPosition(0, 0, 2, 1))
        if deepspeeds_defaults:  # what pipeline.use_reentrant=false gave before fathom chose its own
            set_checkpoint_function(engine.module, non_reentrant_checkpoint)
        batches = itertools.cycle([synthetic_batch(20, 2, 5, 4), synthetic_batch(20, 2, 7, 6)])
        losses = []
        for step in range(steps):
            masks.start(step)
            losses.append(engine.train_batch(data_iter=batches).item())
        weights = [p.detach().clone() for p in engine.module.parameters()]
    return losses, weights


@pytest.mark.slow  # builds and trains DeepSpeed's engine
def test_fathoms_settings_train_what_deepspeeds_defaults_train(process_group):
    cfg = ModelConfig(encoder_layers=2, decoder_layers=2, embed_dim=16, ffn_dim=32, attention_heads=2,
                      src_vocab_size=20, tgt_vocab_size=20, dropout=0.3, attention_dropout=0.2,
                      norm_scheme="deepnorm")  # fmt: skip
    ours, theirs = trained(cfg, deepspeeds_defaults=False), trained(cfg, deepspeeds_defaults=True)
    assert ours[0] == theirs[0] and len(set(ours[0])) == len(ours[0])  # the losses, and the model trained
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))
