"""train.compile: Transformer layers compiled with torch.compile train as the eager ones do, in the
pipeline engine with activation checkpointing; without a compiler it is one line before launch."""

import importlib
import math

import pytest
import torch

from fathom.common.errors import ConfigError
from fathom.model.layers import compile_layers
from fathom.model.model_config import ModelConfig
from fathom.pipeline.launch import checks
from fathom.pipeline.launch.checks import parse_train_args
from tests.helpers import ROOT, final_layers, launch, logged_steps, trained_in_process

DEFAULT = ROOT / "ds_configs" / "default.json"


def test_compile_without_a_compiler_is_one_line(monkeypatch):
    # Inductor reads CXX once, when its config is first imported (which the run's checks may do): imported
    # before CXX is set, the missing compiler does not outlive this test in the worker's later compiles.
    importlib.import_module("torch._inductor.config")
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parse_train_args(["--config", str(DEFAULT), "--override", "train.compile=true"])
    with pytest.raises(ConfigError) as err:
        checks.check_run(args, 2)
    assert str(err.value).startswith("train.compile: torch.compile cannot build kernels here: no C++ compiler")


@pytest.mark.slow
def test_compiled_layers_train_like_eager_ones_at_two_stages(tmp_path):
    """The default job (2 stages, ZeRO-1, BranchNorm; 2+2 layers, a graph per layer kind whatever the depth)
    with activation checkpointing every layer, without dropout, 3 steps, eager and compiled: the same
    losses and gradient norms, and the same weights under the same parameter names (checkpoints do not
    change), to float tolerance. (With dropout the two draw different masks: inductor has its own random
    numbers.)"""
    runs = {}
    for compiled in ("false", "true"):
        save_dir = tmp_path / f"compile-{compiled}"
        overrides = [f"train.save_dir={save_dir}", "train.max_steps=3", "train.save_interval=3",
                     "model.encoder_layers=2", "model.decoder_layers=2", "model.dropout=0", f"train.compile={compiled}",
                     "pipeline.activation_checkpoint_interval=1"]  # fmt: skip
        result = launch(ROOT / "scripts" / "train.py", "--config", str(DEFAULT), "--override", *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[compiled] = save_dir
    eager, compiled = (logged_steps(runs[c]) for c in ("false", "true"))
    assert [r["step"] for r in eager] == [r["step"] for r in compiled] == [1, 2, 3]
    for a, b in zip(eager, compiled, strict=True):
        for key in ("loss", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4), (key, a, b)
    eager_layers, compiled_layers = final_layers(runs["false"]), final_layers(runs["true"])
    assert list(eager_layers) == list(compiled_layers)
    for name, state in eager_layers.items():
        assert list(compiled_layers[name]) == list(state), name
        for key, value in state.items():
            torch.testing.assert_close(compiled_layers[name][key], value, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.slow  # compiles and trains DeepSpeed's engine
def test_compiled_layers_recompute_the_masks_their_forward_drew(process_group):
    """With dropout, a compiled layer draws inductor's random numbers, not eager torch's. A checkpointed
    layer runs its compiled forward twice, once without autograd and once with it, two graphs: each
    must draw the masks the other drew, or the gradients belong to another forward than the loss.
    Compiled with checkpointing every layer and without: the same losses, and the same weights after 3
    steps, to float tolerance. (Adam's eps is large: the k biases' gradients are zero but for rounding,
    which a small eps would turn into full-size steps.) The layers compile for dynamic shapes from the
    first micro-batch, as a run's layers are after its first lengths: the second length reuses those
    graphs instead of adding a static set (half the compiles; the masks are drawn the same way in both)."""
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=16, ffn_dim=32, attention_heads=2,
                      src_vocab_size=20, tgt_vocab_size=20, dropout=0.3, attention_dropout=0.2,
                      norm_scheme="deepnorm")  # fmt: skip
    runs = []
    for interval in (1, 0):
        ds = {
            "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "eps": 1e-3, "torch_adam": True}},
            "pipeline": {"stages": 1, "activation_checkpoint_interval": interval},
        }  # fmt: skip
        with torch._dynamo.config.patch(assume_static_by_default=False):
            runs.append(trained_in_process(cfg, ds, lambda engine: compile_layers(engine.module)))
    (checkpointed, checkpointed_weights), (kept, kept_weights) = runs
    assert len(set(kept)) == len(kept)  # it trained
    for a, b in zip(checkpointed, kept, strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (checkpointed, kept)
    for a, b in zip(checkpointed_weights, kept_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
