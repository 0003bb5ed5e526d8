"""The memory planner (pipeline/parts/stage_memory.py, planner/estimate.py): its arithmetic by hand, and its
prediction against a real run."""

import json
import subprocess
import sys

import pytest

from fathom.common.run_layout import MEMORY_FILE
from fathom.common.sizes import GiB
from fathom.pipeline.config.run_config import load_config
from fathom.pipeline.parts.activation_trace import trace_layers
from fathom.pipeline.parts.stage_memory import (
    FIXED_BYTES,
    Device,
    MicroBatchShape,
    estimate_stages,
    micro_batch_shape,
    parse_size,
)
from fathom.planner.estimate import fill_vocab_and_length, main, smallest_stage_count
from tests.helpers import ROOT, launch

TINY = [
    "model.encoder_layers=1", "model.decoder_layers=1", "model.embed_dim=8", "model.ffn_dim=16",
    "model.attention_heads=2", "model.src_vocab_size=10", "model.tgt_vocab_size=10", "pipeline.stages=1",
]  # fmt: skip


def config(*overrides: str):
    return load_config(ROOT / "ds_configs" / "default.json", [*TINY, *overrides], world_size=None)


@pytest.mark.parametrize(
    "precision, zero, fused, per_param, step",
    [
        ("fp32", 0, True, 4 + 4 + 8, 4),  # the all-reduce's flat copy, with 2 data-parallel ranks
        # ZeRO-1 flattens every gradient (4 or 2 bytes) and at the step holds its partition's fp32
        # gradients (4 / 2) and, unless AdamW is fused, its sqrt and division temporaries (8 / 2)
        ("fp32", 1, True, 4 + 4 + 12 / 2, 4),
        ("fp32", 1, False, 4 + 4 + 12 / 2, 12 / 2),
        ("bf16", 1, True, 2 + 2 + 12 / 2, 4 / 2),
    ],
)
def test_model_states_by_hand(precision, zero, fused, per_param, step):
    """d 8, f 16, vocab 10, untied: encoder layer 4 x (64 + 8) + (128 + 16) + (128 + 8) + 2 LayerNorms
    x 16 = 600; the decoder layer adds an attention and a LayerNorm: 904; three 10 x 8 tables: 240.
    Bytes per parameter: weights + gradients + the optimizer state (ZeRO-1: over 2 data-parallel ranks)."""
    cfg = config(
        f"bf16.enabled={str(precision == 'bf16').lower()}",
        f"zero_optimization.stage={zero}",
        f"optimizer.params.fused={str(fused).lower()}",
    )
    (stage,) = estimate_stages(cfg, trace_layers(cfg, 5), MicroBatchShape(1, 5), stages=1, data_parallel=2)
    assert stage.params == 1744
    assert stage.model_states == int(1744 * per_param)
    assert stage.transient == int(1744 * step)
    assert stage.fixed == FIXED_BYTES["gpu"]
    cpu = estimate_stages(cfg, trace_layers(cfg, 5), MicroBatchShape(1, 5), 1, 2, device=Device("cpu"))[0]
    assert cpu.fixed == FIXED_BYTES["cpu"] and cpu.peak == stage.allocated + FIXED_BYTES["cpu"]


def test_checkpointed_layers_hold_only_their_inputs():
    """With a checkpoint per layer, two more encoder layers hold two more inputs per sentence in flight
    (length x d x 4 bytes) and nothing else; without checkpoints each holds far more."""
    shape = MicroBatchShape(sentences=3, length=5)

    def activations(*overrides: str) -> int:
        cfg = config(
            "pipeline.activation_checkpoint_interval=1",
            "gradient_accumulation_steps=1",
            "train_batch_size=8",
            *overrides,
        )
        return estimate_stages(cfg, trace_layers(cfg, shape.length), shape, stages=1)[0].activations

    grown = activations("model.encoder_layers=3") - activations("model.encoder_layers=1")
    assert grown == 2 * 3 * 5 * 8 * 4

    def uncheckpointed(layers: int) -> int:
        return activations(f"model.encoder_layers={layers}", "pipeline.activation_checkpoint_interval=0")

    assert uncheckpointed(3) - uncheckpointed(1) > 5 * grown


def test_first_stage_holds_a_micro_batch_per_later_stage():
    """1F1B: stage s of S keeps min(S - s, micro-batches) forward passes for backward."""
    layers = ["model.encoder_layers=4", "model.decoder_layers=4", "pipeline.activation_checkpoint_interval=0"]
    single = config(*layers, "gradient_accumulation_steps=1", "train_batch_size=8")
    several = config(*layers)  # 4 micro-batches per step
    traces, shape = trace_layers(single, 5), MicroBatchShape(2, 5)
    first, last = (estimate_stages(several, traces, shape, stages=2)[s].activations for s in (0, 1))
    assert estimate_stages(single, traces, shape, stages=2)[0].activations * 2 == first
    assert estimate_stages(single, traces, shape, stages=2)[1].activations == last


@pytest.mark.parametrize("interval", [0, 1])
def test_fewest_stages_that_fit(interval):
    """The answer is the first stage count, counting up, whose peaks fit, for every budget between two
    counts' peaks. Without activation checkpointing the peaks do not shrink monotonically (3 stages
    need less than 4 here: the first stage holds a micro-batch more per stage), which a bisection alone
    got wrong."""
    cfg = config(
        "model.encoder_layers=6", "model.decoder_layers=6", f"pipeline.activation_checkpoint_interval={interval}"
    )
    traces, shape = trace_layers(cfg, 5), MicroBatchShape(8, 5)
    peaks = [max(s.peak for s in estimate_stages(cfg, traces, shape, stages)) for stages in range(1, 13)]
    if not interval:
        assert peaks[2] < peaks[3]
    for budget in sorted({*peaks, *(p - 1 for p in peaks)}):
        fewest = next((stages for stages, peak in enumerate(peaks, 1) if peak <= budget), None)
        assert smallest_stage_count(cfg, traces, shape, budget) == fewest, budget


@pytest.mark.slow
def test_sizes_and_bad_input():
    assert parse_size("80GB") == 80 * 10**9 and parse_size("40GiB") == 40 * GiB and parse_size("512") == 512 * 10**9
    result = subprocess.run(
        [sys.executable, "scripts/estimate_memory.py", "--config", "ds_configs/default.json", "--gpu-memory", "lots"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2
    assert "fathom: error: --gpu-memory 'lots': expected a size like 80GB or 40GiB" in result.stderr


def test_stages_zero_is_refused_not_ignored(capsys):
    """--stages 0 used to fall back to the config's stage count silently."""
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(ROOT / "ds_configs" / "default.json"), "--stages", "0"])
    assert exc.value.code == 2
    assert "--stages: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "record, message",
    [
        ("garbage", "is not a run's memory record"),  # each was a traceback
        ('[{"rank": 0}]', "is not a run's memory record"),
        ("[]", "holds no ranks"),
        ('[{"rank": 0, "stage": 2, "baseline": 1, "peak": 2}]', "had 3 stages; estimate with --stages 3"),
    ],
)
def test_a_damaged_measured_record_is_one_line(tmp_path, capsys, record, message):
    (tmp_path / MEMORY_FILE).write_text(record)
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(ROOT / "ds_configs" / "default.json"), "--measured", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


# (model overrides, the stages' layer counts): 2L-2L d 64, a stage's fixed part ten times its model; 12L-12L
# d 256 without checkpointing, a model 5x the fixed part; 48L-48L d 64, the most layers
SIZES = {
    "2L-2L": ["model.encoder_layers=2", "model.decoder_layers=2"],
    "12L-12L d256": ["model.encoder_layers=12", "model.decoder_layers=12", "model.embed_dim=256", "model.ffn_dim=1024"],
    "48L-48L": ["model.encoder_layers=48", "model.decoder_layers=48", "pipeline.activation_checkpoint_interval=1"],
}  # fmt: skip
MARGIN_BYTES, MARGIN_SHARE = 32 * 2**20, 0.15  # the estimate is within the larger of the two of a measured peak


@pytest.mark.slow
@pytest.mark.parametrize("size", list(SIZES))
def test_the_estimate_is_within_its_margin_of_a_measured_run(tmp_path, size):
    """2 stages, ZeRO-1, fp32 on this CPU with train.cpu_heap=return: each rank's peak resident memory above what
    it held before the model (pipeline/reports/memory.py) against the planner's stage peak, its fixed part
    included (FIXED_BYTES["cpu"]). The fixed part was 128 MiB where 2L-2L ranks measured 27-29 MiB in all (the
    estimate 4.6x theirs); measured with return, it is 24-66 MiB from 2L-2L to 48L-48L (docs/BENCHMARKS.md)."""
    overrides = [*SIZES[size], "train.max_steps=3", f"train.save_dir={tmp_path}", "train.save_interval=1000",
                 "train.cpu_heap=return"]  # freed tensors handed back: the process holds what it uses  # fmt: skip
    result = launch("scripts/train.py", "--config", "ds_configs/default.json", "--override", *overrides)
    assert result.returncode == 0
    measured = json.loads((tmp_path / MEMORY_FILE).read_text())
    cfg = load_config(ROOT / "ds_configs" / "default.json", overrides, world_size=None)
    shape = micro_batch_shape(cfg, None, fill_vocab_and_length(cfg, None))
    estimates = estimate_stages(cfg, trace_layers(cfg, shape.length), shape, stages=2, device=Device("cpu"))
    for rank in measured:
        predicted, actual = estimates[rank["stage"]].peak, rank["peak"] - rank["baseline"]
        assert abs(predicted - actual) <= max(MARGIN_BYTES, MARGIN_SHARE * actual), (rank, predicted)


def plan_refused(capsys, *argv: str) -> str:
    """The one line `fathom-plan --config default ARGV` ends with, exit status 2, nothing printed."""
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(ROOT / "ds_configs" / "default.json"), *argv])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu-memory", "1.2.3GB"], "--gpu-memory '1.2.3GB': expected a size like 80GB"),  # each a ValueError once
        (["--gpu-memory", "80..GB"], "--gpu-memory '80..GB': expected a size like 80GB"),
        (["--gpu-memory", "."], "--gpu-memory '.': expected a size like 80GB"),
        (["--gpu-memory", ""], "--gpu-memory '': expected a size like 80GB"),  # was taken as no --gpu-memory
        (["--gpu-memory", "0GB"], "--gpu-memory: '0GB' is no memory"),  # was planned: "does not fit in 0.00 GiB"
        (["--gpu-memory", "0.0000000001GB"], "--gpu-memory: '0.0000000001GB' is no memory"),
        (["--gpu-memory", "9" * 400], "not a size any machine has"),  # float() gives inf: an OverflowError
        (["--override", 'pipeline.activation_checkpoint_interval="auto"', f"train.memory_budget={'9' * 400}GB"],
         "train.memory_budget '999"),  # the same parser, the same OverflowError
        (["--override", 'pipeline.activation_checkpoint_interval="auto"', "train.memory_budget=.GB"],
         "train.memory_budget '.GB': expected a size like 80GB"),
    ],
)  # fmt: skip
def test_a_memory_that_is_no_size_is_one_line(capsys, argv, message):
    assert message in plan_refused(capsys, *argv)


@pytest.mark.parametrize("learned", ["true", "false"])
def test_a_length_past_max_positions_is_one_line(capsys, learned):
    """Learned positions: an IndexError traceback (the table has no row for it); sinusoids: an estimate for
    pairs a run refuses (pipeline/launch/checks.py)."""
    positions = [f"model.learned_pos={learned}", "model.max_positions=64"]
    err = plan_refused(capsys, "--length", "65", "--override", *positions)
    assert "--length 65: beyond model.max_positions 64, the longest pair a run takes; give --length 64 or less" in err
    err = plan_refused(capsys, "--override", positions[0], "model.max_positions=5")  # the data's longest: 7 tokens
    assert "model.max_positions: 5 is below the data's longest pair (7 tokens), which a run refuses" in err
    main(["--config", str(ROOT / "ds_configs" / "default.json"), "--length", "64", "--override", *positions])
    assert "micro-batch 8 x 64 tokens" in capsys.readouterr().out  # up to max_positions itself
