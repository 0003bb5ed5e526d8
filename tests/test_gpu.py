"""fp16 training with ZeRO-1, which needs a GPU (the config refuses it on CPUs): the loss scaler's
routine overflows are skipped without ending the run, its scale survives --resume, and a real divergence
stops the run or is skipped as in fp32 and bf16 (tests/test_stability.py). One GPU, one pipeline stage,
the real launcher. Skipped without CUDA; on a GPU machine: `pytest -m gpu`."""

import math

import pytest
import torch

from fathom.model.parts import module_names
from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.safety.divergence import NONFINITE_EXIT
from tests.helpers import ROOT, launch
from tests.test_stability import CONFIG, SMALL, WORKER, jsonl, same_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ONE_GPU = [*SMALL, "pipeline.stages=1"]
OVERFLOW = "fp16 gradient overflow (DeepSpeed's loss scaler)"


def fp16(initial_scale_power: int) -> list[str]:
    return ["fp16.enabled=true", f"fp16.initial_scale_power={initial_scale_power}"]


def train(save, *overrides, resume=False):
    args = ["--config", str(CONFIG), "--override", *ONE_GPU, *overrides, f"train.save_dir={save}"]
    return launch(ROOT / "scripts" / "train.py", *args, *(["--resume"] if resume else []), processes=1)


def where(name, overrides=()):
    cfg, _ = resolve_run(CONFIG, [*ONE_GPU, *overrides], world_size=1)
    return f"stage 0, layer {module_names(cfg.model).index(name)} ({name})"


def test_fp16_overflows_are_skipped_and_the_loss_scale_survives_resume(tmp_path):
    # 2^28 overflows a small model's gradients: the first steps are skipped while the scale comes down.
    overrides = [*fp16(28), "train.max_steps=40", "train.save_interval=20"]
    full = train(tmp_path / "full", *overrides)
    assert full.returncode == 0
    records = jsonl(tmp_path / "full" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 41))
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped and skipped[0] == 1, records[:3]
    assert all(r["nonfinite"] == OVERFLOW for r in records if r.get("skipped"))
    assert records[-1]["loss_scale"] < 2**28 and all(math.isfinite(r["loss"]) for r in records)
    trained = [r["loss"] for r in records if not r.get("skipped")]
    assert trained[-1] < trained[0]

    cut = tmp_path / "cut"
    assert train(cut, *overrides[:-2], "train.max_steps=20", "train.save_interval=20").returncode == 0
    assert train(cut, *overrides, resume=True).returncode == 0
    resumed = jsonl(cut / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 41))
    # A scaler restarted at 2^24 would overflow again after the resume; the restored one goes on as before.
    assert [r["loss_scale"] for r in resumed[20:]] == [r["loss_scale"] for r in records[20:]]
    assert [r["step"] for r in resumed if r.get("skipped")] == skipped
    for ours, theirs in zip(resumed[20:], records[20:], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-2)


def test_fp16_nonfinite_loss_stops_the_run_naming_the_layer(tmp_path):
    save = tmp_path / "run"
    overrides = [*ONE_GPU, *fp16(8), "train.save_interval=2", "train.max_steps=8"]
    args = ["--config", str(CONFIG), "--override", *overrides, f"train.save_dir={save}"]
    stopped = launch(WORKER, "main", "output:5:decoder.layers.1", *args, processes=1)
    assert stopped.returncode == NONFINITE_EXIT
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("fathom:")]
    assert errors == [
        f"fathom: error: step 5: non-finite loss; first non-finite output: {where('decoder.layers.1')}; "
        "the last checkpoint is global_step4"
    ]
    resumed = launch(ROOT / "scripts" / "train.py", *args, "--resume", processes=1)
    assert resumed.returncode == 0
    assert [r["step"] for r in jsonl(save / "metrics.jsonl")] == list(range(1, 9))


def test_fp16_skip_leaves_weights_and_optimizer_state_as_they_were(tmp_path):
    # an infinite loss with finite gradients, which DeepSpeed's fp16 ZeRO-1 optimizer would apply
    overrides = [*ONE_GPU, *fp16(8), "train.on_nonfinite=skip"]
    overrides += ["train.save_interval=1", "train.max_steps=5"]
    case = ",".join(["logit:3:decoder.output_projection", *overrides])
    result = launch(WORKER, "cases", str(CONFIG), str(tmp_path), f"run={case}", processes=1)
    assert result.returncode == 0
    save = tmp_path / "run"
    records = jsonl(save / "metrics.jsonl")
    assert records[2]["skipped"] and records[2]["nonfinite"] == (
        f"non-finite loss; first non-finite output: {where('decoder.output_projection')}"
    )
    assert not any(r.get("skipped") for r in records[:2] + records[3:])
    for path in sorted((save / "global_step2").glob("*.pt")):
        assert same_state(path, save / "global_step3" / path.name), path.name


def test_the_fused_overflow_check_sees_nan_and_inf_on_cuda():
    """set_gradient_scans's multi-tensor fp64 2-norm on CUDA's fused kernel (same dtype and device: one
    launch) flags a NaN, +inf or -inf in any one of many gradient tensors, as DeepSpeed's check does."""
    import types

    from fathom.pipeline.engine.internals import set_gradient_scans

    grads = [torch.randn(n, device="cuda") for n in (7, 1000, 3, 4096)]
    optimizer = types.SimpleNamespace(
        has_overflow_partitioned_grads_serial=None, cpu_offload=False, bit16_groups=[[]], averaged_gradients={0: grads}
    )
    set_gradient_scans(types.SimpleNamespace(optimizer=optimizer, device=torch.device("cuda")), fused=True)
    assert not optimizer.has_overflow_partitioned_grads_serial().item()
    for value in (math.nan, math.inf, -math.inf):
        for grad in grads:
            kept = grad[-1].item()
            grad[-1] = value
            assert optimizer.has_overflow_partitioned_grads_serial().item(), (value, grad.numel())
            grad[-1] = kept


def test_cuda_graphs_train_as_the_eager_layers_do(tmp_path):
    """train.cuda_graphs replays every Transformer layer from CUDA graphs: with dropout, BranchNorm's alpha
    moving every step and micro-batches of two padded shapes, the losses and gradient norms are those of
    the eager layers (fp32: to float tolerance; bf16, where the graphs multiply by alpha rounded to bf16:
    closely), and a validation pass in between runs the layers eagerly."""
    overrides = [
        "model.dropout=0.1", "model.branchnorm.T=3", "data.pad_to_multiple=4", "data.synthetic.max_len=9",
        "train.max_steps=6", "train.save_interval=6", "train.valid_interval=3",
    ]  # fmt: skip
    for precision, tolerance in (([], 1e-4), (["bf16.enabled=true"], 2e-2)):
        runs = []
        for graphs in ("false", "true"):
            save = tmp_path / f"{graphs}-{len(precision)}"
            assert train(save, *overrides, *precision, f"train.cuda_graphs={graphs}").returncode == 0
            runs.append(jsonl(save / "metrics.jsonl"))
        eager, graphed = runs
        assert [r["step"] for r in graphed] == list(range(1, 7))
        for ours, theirs in zip(graphed, eager, strict=True):
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=tolerance), (precision, ours["step"])
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=10 * tolerance), (
                precision,
                ours["step"],
            )
