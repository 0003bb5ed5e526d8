"""The settings fathom gives DeepSpeed's engine for speed (docs/TRAINING.md, "Settings fathom picks for the
engine") fill only what a config leaves out, and train exactly what DeepSpeed's own defaults train: the
same losses and weights, bit for bit, with dropout and activation checkpointing on."""

import pytest
import torch

from fathom.model.model_config import ModelConfig
from fathom.pipeline.config.engine_defaults import engine_config
from fathom.tools.step_profile import use_deepspeeds_own
from tests.helpers import trained_in_process


def test_defaults_fill_only_what_the_config_leaves_out():
    ds = {"zero_optimization": {"stage": 1}, "pipeline": {"stages": 1}}
    assert engine_config(ds) == {
        "zero_optimization": {"stage": 1, "contiguous_gradients": False},
        "pipeline": {"stages": 1, "use_reentrant": False},
        "timers": {"throughput": {"enabled": False}},
    }
    assert ds == {"zero_optimization": {"stage": 1}, "pipeline": {"stages": 1}}  # the run's own config untouched
    chosen = {
        "pipeline": {"use_reentrant": True},
        "zero_optimization": {"stage": 1, "contiguous_gradients": True},
        "timers": {"throughput": {"enabled": True}},
    }
    assert engine_config(chosen) == chosen
    # overlap_comm stages gradients in the hooks' buckets; ZeRO-0 has no such hooks
    assert (
        "contiguous_gradients"
        not in engine_config({"zero_optimization": {"stage": 1, "overlap_comm": True}})["zero_optimization"]
    )
    assert "contiguous_gradients" not in engine_config({}).get("zero_optimization", {})


def trained(cfg: ModelConfig, deepspeeds_defaults: bool, bf16: bool) -> tuple[list[float], list[torch.Tensor]]:
    """Three steps, 2 micro-batches a step, every layer checkpointed, with fathom's settings or
    DeepSpeed's (bf16: ZeRO-1 then checks the gradients for overflow every step)."""
    ds = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
        "pipeline": {"stages": 1, "activation_checkpoint_interval": 1, "use_reentrant": False},
        "bf16": {"enabled": bf16},
    }  # fmt: skip
    if not deepspeeds_defaults:
        return trained_in_process(cfg, ds)
    return trained_in_process(cfg, ds, use_deepspeeds_own, deepspeeds=True)


@pytest.mark.slow  # builds and trains DeepSpeed's engine
@pytest.mark.parametrize("bf16", [False, True])
def test_fathoms_settings_train_what_deepspeeds_defaults_train(process_group, bf16):
    cfg = ModelConfig(encoder_layers=2, decoder_layers=2, embed_dim=16, ffn_dim=32, attention_heads=2,
                      src_vocab_size=20, tgt_vocab_size=20, dropout=0.3, attention_dropout=0.2,
                      norm_scheme="deepnorm")  # fmt: skip
    ours, theirs = (trained(cfg, deepspeeds_defaults, bf16) for deepspeeds_defaults in (False, True))
    assert ours[0] == theirs[0] and len(set(ours[0])) == len(ours[0])  # the losses, and the model trained
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))


@pytest.mark.slow  # builds and trains DeepSpeed's engine
def test_memory_breakdown_reports_in_fathoms_engine(process_group, capfd):
    """DeepSpeed's memory_breakdown prints its memory lines around each micro-batch of fathom's engine. In
    process, for one step: it collects garbage at every line, which made a 12-step launch 3x slower."""
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=16, ffn_dim=32, attention_heads=2,
                      src_vocab_size=20, tgt_vocab_size=20)  # fmt: skip
    ds = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1}, "pipeline": {"stages": 1}, "memory_breakdown": True,
    }  # fmt: skip
    trained_in_process(cfg, ds, steps=1)
    out = capfd.readouterr().out
    assert out.count("Engine before forward") == 2 and "CPU Virtual Memory" in out  # one per micro-batch
