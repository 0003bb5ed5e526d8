"""The benchmark's arithmetic (scripts/bench.py times little here): model FLOPs against torch's own
FLOP counter on a real training step, the fixed batch's layout, the autocast loop's precision, the
profile's counts, and its refusals of bad arguments."""

import gzip
import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fathom.common.errors import ConfigError
from fathom.model import ModelConfig, Transformer
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import PAD
from fathom.tools.gpu_check_report import gpu_check_summary
from fathom.tools.in_process_engine import check_device
from fathom.tools.step_profile import ProfileBench, counted, profile_systems
from fathom.tools.timed_steps import plain_loop, synthetic_batch
from fathom.tools.training_speed import model_flops
from tests.helpers import ROOT

TINY = ModelConfig(
    encoder_layers=2, decoder_layers=2, embed_dim=16, ffn_dim=32, attention_heads=2, src_vocab_size=20,
    tgt_vocab_size=20,
)  # fmt: skip


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
        (["--profile", "--systems", "plain,nope"], "--systems: unknown nope; choose from plain, plain-checkpointed"),
        (["--profile", "--systems", "engine"], "--systems: plain is what the others are measured against"),
        (["--systems", "plain"], "--systems: an option of --profile; add --profile or leave --systems out"),
        (["--trace", "/tmp/t"], "--trace: an option of --profile; add --profile or leave --trace out"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: torch sees no CUDA GPU on this machine",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU"),
        ),
    ],
)
def test_bench_refuses_bad_arguments_before_timing(args, message):
    result = subprocess.run(
        [sys.executable, "scripts/bench.py", "--layers", "1", "--steps", "1", *args],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-2000:]


def test_a_device_torch_cannot_use_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--device cuda:1: torch sees no CUDA GPU on this machine; run on"):
        check_device("cuda:1", engine=False)
    with pytest.raises(ConfigError, match=r"^--device tpu: not a device here; choose cpu, cuda or cuda:N$"):
        check_device("tpu", engine=False)


def test_autocast_trains_fp32_weights_on_bf16_logits():
    model = Transformer(TINY).train()
    losses = []

    def logits(src, prev):
        out = model(src, prev)
        losses.append(label_smoothed_cross_entropy(out, target).item())
        assert out.dtype == torch.bfloat16  # the forward ran under autocast
        return out

    batch = synthetic_batch(20, 2, 5, 5)
    target = batch[1]
    step = plain_loop(model, logits, batch, "autocast", "cpu")
    step()
    step()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trained)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_profile_counts_aten_ops_and_no_kernels_on_a_cpu():
    x = torch.randn(4, 4)
    aten, launches, kernel_s = counted(lambda: (x @ x).relu_(), "cpu")
    assert aten >= 2 and launches == 0 and kernel_s == 0


@pytest.mark.slow  # builds and trains DeepSpeed's engine
def test_profile_times_every_system(process_group, tmp_path):
    bench = ProfileBench(
        model=TINY, batch=2, src_len=5, tgt_len=4, micro_batches=2, checkpoint_interval=1, precision="fp32",
        device="cpu", warmup=1, steps=2,
    )  # fmt: skip
    profiles = profile_systems(bench)
    assert [p.system for p in profiles] == ["plain", "plain-checkpointed", "engine-deepspeed", "engine"]
    plain, engine = profiles[0], profiles[-1]
    for p in profiles:
        assert p.step_s > 0 and p.aten_ops > 0 and p.kernel_launches == 0 and p.kernel_s == 0
        assert p.depth == 2 and p.layer_passes == 4 * 2
    # the engine recomputes every layer's forward in the backward pass: more ops than the plain loop
    assert engine.aten_ops > plain.aten_ops
    chosen = profile_systems(replace(bench, systems=("engine", "plain"), trace=tmp_path / "traces"))
    assert [p.system for p in chosen] == ["engine", "plain"]
    # each system's profiled step as a Chrome trace, with the Python frames that issued its ops
    for system in ("engine", "plain"):
        with gzip.open(tmp_path / "traces" / f"{system}-2L.json.gz", "rt") as trace:
            events = json.load(trace)["traceEvents"]
        names = {event.get("name", "") for event in events}
        assert "aten::addmm" in names and any(name.startswith("model/layers.py") for name in names), system


def test_gpu_check_summary_reads_whatever_the_pieces_left(tmp_path):
    """One table from scripts/gpu_check.sh's OUT_DIR, also when pieces were cut off by their caps: a
    bench's figures, the profile's systems that ran, how far the 500L run got, the tests' last line."""
    model = {"encoder_layers": 6, "decoder_layers": 6, "embed_dim": 512, "ffn_dim": 2048}
    results = [
        {"system": system, "step_s": step_s, "tokens_per_s": 1000 / step_s, "peak_fraction": 0.01 / step_s}
        for system, step_s in (("fathom", 0.05), ("bf16-weights", 0.04), ("deepspeed", 0.1))
    ]
    (tmp_path / "bench1.json").write_text(json.dumps({"bench": {"model": model, "batch": 128}, "results": results}))
    (tmp_path / "bench1.rc").write_text("0\n")
    (tmp_path / "bench2.rc").write_text("124\n")
    profiles = [
        {"system": system, "depth": 100, "step_s": step_s, "kernel_s": 0.5, "layer_passes": 800}
        for system, step_s in (("plain", 1.0), ("engine", 4.0), ("engine-compiled", 2.0), ("engine-graphed", 0.8))
    ]
    (tmp_path / "profile.json").write_text(json.dumps({"results": profiles}))
    (tmp_path / "train500.txt").write_text("fathom: stage 0\nstep 1/4 | loss 3.5 | 8 tok/s\nstep 2/4 | loss 3.4\n")
    (tmp_path / "train500.rc").write_text("124\n")
    (tmp_path / "test_gpu.txt").write_text("...\n3 passed in 95.21s\n")
    (tmp_path / "test_gpu.rc").write_text("0\n")
    rows = [line.split(" | ") for line in gpu_check_summary(tmp_path).splitlines()]
    assert rows[2] == ["| bench 6L-6L d512 ffn2048 batch 128", "20,000 tok/s, MFU 20.0%", "25,000 tok/s, MFU 25.0%",
                       "-", "10,000 tok/s, MFU 10.0%", "x2.00 |"]  # fmt: skip
    assert rows[3][:2] == ["| bench2", "exit 124"]
    assert rows[4] == ["| profile 100L-100L: host / layer / micro-batch", "1.250 ms", "", "", "5.000 ms",
                       "x4.00; compiled x2.00, 2.500 ms, GPU busy 25.0%; "
                       "CUDA graphs x0.80, 1.000 ms, GPU busy 62.5% |"]  # fmt: skip
    assert rows[5][1] == "50.0%" and rows[5][4] == "12.5%"
    assert rows[6][0] == "| train500" and rows[6][4] == "stopped after step 2/4 exit 124"
    assert rows[7][4] == "3 passed in 95.21s"
