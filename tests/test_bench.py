"""The benchmark's arithmetic (scripts/bench.py times nothing here): model FLOPs against torch's own
FLOP counter on a real training step, the fixed batch's layout, and its refusals of bad arguments."""

import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model import ModelConfig, Transformer
from model.loss import label_smoothed_cross_entropy
from model.model_config import PAD
from tests.helpers import ROOT
from tools.training_speed import model_flops, synthetic_batch


@pytest.mark.parametrize("n, m, src_len, tgt_len", [(2, 2, 16, 16), (3, 1, 12, 20)])
def test_model_flops_equal_torchs_count_of_a_training_step(n, m, src_len, tgt_len):
    cfg = ModelConfig(
        encoder_layers=n, decoder_layers=m, embed_dim=32, ffn_dim=96, attention_heads=4, dropout=0.0,
        src_vocab_size=50, tgt_vocab_size=50,
    )  # fmt: skip
    (src, prev), target = synthetic_batch(50, 3, src_len, tgt_len)
    # The math backend runs attention as bmm, which the counter sees (CPU flash attention it does not).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        label_smoothed_cross_entropy(Transformer(cfg)(src, prev), target).backward()
    assert counter.get_total_flops() == model_flops(cfg, src_len, tgt_len, batch=3)


def test_synthetic_batch_is_full_length_without_padding():
    (src, prev), target = synthetic_batch(20, 4, 7, 5)
    assert src.shape == (4, 7) and prev.shape == target.shape == (4, 5)
    assert not any(t.eq(PAD).any() for t in (src, prev, target))
    assert torch.equal(prev[:, 1:], target[:, :-1])  # the decoder reads the target shifted right


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--scheme", "nope"], "model.norm_scheme: unknown scheme 'nope'"),  # a traceback when first built
        (["--warmup", "-1"], "--warmup: must be at least 0, got -1"),
        (["--json", "/no-dir/bench.json"], "--json /no-dir/bench.json: /no-dir is not a directory"),  # after timing
    ],
)
def test_bench_refuses_bad_arguments_before_timing(args, message):
    result = subprocess.run(
        [sys.executable, "scripts/bench.py", "--layers", "1", "--steps", "1", *args],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-2000:]
