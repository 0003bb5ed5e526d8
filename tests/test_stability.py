"""Divergence handling (pipeline/safety/divergence.py): a non-finite loss or gradient is caught on its step,
named, and stops the run or is skipped; per-layer gradient norms. The slow tests inject faults into
real 2-stage runs (tests/workers/faults.py) under the real launcher."""

import bisect
import json
import math

import pytest
import torch

from fathom.common.errors import ConfigError
from fathom.common.run_layout import GRAD_NORMS_FILE
from fathom.corpus.batches import MicroBatches
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.parts import module_names, saved_names
from fathom.model.trained import load_reference
from fathom.pipeline.config.run_config import load_config
from fathom.pipeline.config.run_data import build_corpus, resolve_run
from fathom.pipeline.parts.stage_cuts import stage_bounds
from fathom.pipeline.safety.divergence import NONFINITE_EXIT, describe
from tests.helpers import ROOT, launch

CONFIG = ROOT / "ds_configs" / "default.json"
WORKER = ROOT / "tests" / "workers" / "faults.py"
# default.json (BranchNorm, ZeRO-1, Adam with warm-up, gradient clipping) with activation checkpointing,
# small, without dropout so that the single-process model replays a step exactly
SMALL = [
    "pipeline.activation_checkpoint_interval=1",
    "model.encoder_layers=2", "model.decoder_layers=2", "model.embed_dim=32", "model.ffn_dim=64",
    "model.dropout=0", "data.synthetic.sentences=200", "train.log_interval=1",
]  # fmt: skip


def test_describe_names_the_first_nonfinite_output_and_its_stage():
    names, bounds = ["embed", "a", "b", "c", "out"], [0, 2, 5]
    outputs = [False, False, True, True, True]
    assert describe(True, outputs, [True] * 5, names, bounds) == (
        "non-finite loss; first non-finite output: stage 1, layer 2 (b)"
    )


def test_describe_with_finite_outputs_names_the_gradient_that_broke_first_in_backward_order():
    names, bounds = ["embed", "a", "b", "c", "out"], [0, 2, 5]
    found = describe(False, [False] * 5, [True, True, False, False, False], names, bounds)
    assert found == (
        "non-finite gradient; outputs finite; non-finite parameter gradients in 2 layer(s), "
        "the first in backward order: stage 0, layer 1 (a)"
    )
    assert describe(True, [False] * 5, [False] * 5, names, bounds) == (
        "non-finite loss; every layer's output and gradient finite"
    )


def test_describe_lets_through_a_step_whose_loss_and_gradients_are_finite():
    # A non-finite activation that reaches neither (e.g. at a padded position) does not harm the weights.
    assert describe(False, [False, True, False], [False] * 3, ["a", "b", "c"], [0, 1, 3]) is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.on_nonfinite=ignore", "train.on_nonfinite: 'ignore'; choose one of stop, skip"),
        ("train.grad_norm_interval=-1", "train.grad_norm_interval: must be at least 0 (0: never), got -1"),
    ],
)
def test_bad_divergence_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [override])
    assert str(err.value) == message


def model_config(overrides):
    return resolve_run(CONFIG, overrides, world_size=2)[0].model


def where(overrides, name):
    """'stage S, layer L (name)' computed from the config, independently of pipeline/safety/divergence.py."""
    cfg = model_config(overrides)
    layer = module_names(cfg).index(name)
    return f"stage {bisect.bisect_right(stage_bounds(cfg, 2), layer) - 1}, layer {layer} ({name})"


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_stop_names_the_layer_and_keeps_the_last_checkpoint_for_resume(tmp_path):
    save = tmp_path / "run"
    overrides = [*SMALL, "train.save_interval=2", "train.max_steps=8", "train.grad_norm_interval=1"]
    args = ["--config", str(CONFIG), "--override", *overrides, f"train.save_dir={save}"]
    stopped = launch(WORKER, "main", "output:5:decoder.layers.1", *args)

    assert stopped.returncode == NONFINITE_EXIT
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("fathom:")]
    assert errors == [
        f"fathom: error: step 5: non-finite loss; first non-finite output: {where(overrides, 'decoder.layers.1')}; "
        "the last checkpoint is global_step4"
    ]
    assert "Traceback" not in stopped.stdout + stopped.stderr
    assert (save / "latest").read_text().strip() == "global_step4" and not (save / "global_step5").exists()
    assert jsonl(save / "metrics.jsonl")[-1]["step"] == 5 and jsonl(save / "metrics.jsonl")[-1]["skipped"]

    resumed = launch(ROOT / "scripts" / "train.py", *args, "--resume")
    assert resumed.returncode == 0 and "at step 4" in resumed.stdout
    records = jsonl(save / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9)) and not any("skipped" in r for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
    # The resumed run replaced the grad-norm lines after its checkpoint, as metrics.jsonl's.
    norms = jsonl(save / GRAD_NORMS_FILE)
    assert [r["step"] for r in norms] == list(range(1, 9))
    assert all(math.isfinite(v) for r in norms for v in r["norms"].values())


SKIP = [*SMALL, "train.on_nonfinite=skip", "train.save_interval=1", "train.max_steps=5", "train.grad_norm_interval=2"]
# case: (fault, overrides); every fault strikes at step 3
SKIP_CASES = {
    # DeepSpeed's ZeRO-1 skips non-finite gradients itself; tied tables cross the stages
    "zero1": ("output:3:encoder.layers.0", ["model.share_all_embeddings=true"]),
    # plain fp32 Adam with gradient clipping: nothing in DeepSpeed would stop NaN weights
    "zero0": ("output:3:encoder.layers.0", ["zero_optimization.stage=0"]),
    "zero1_bf16": ("output:3:encoder.layers.0", ['bf16={"enabled": true}']),
    "gradient": ("gradient:3:decoder.layers.0", []),
    # an infinite loss with finite gradients, which DeepSpeed's optimizers would apply
    "logit": ("logit:3:decoder.output_projection", []),
}


def expected_message(case):
    fault, overrides = SKIP_CASES[case]
    kind, _, name = fault.split(":")
    layer = where([*SKIP, *overrides], name)
    if kind == "gradient":
        return (
            "non-finite gradient; outputs finite; non-finite parameter gradients in 1 layer(s), "
            f"the first in backward order: {layer}"
        )
    return f"non-finite loss; first non-finite output: {layer}"


@pytest.fixture(scope="module")
def skip_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("skip")
    cases = [f"{name}={','.join([fault, *SKIP, *overrides])}" for name, (fault, overrides) in SKIP_CASES.items()]
    result = launch(WORKER, "cases", str(CONFIG), str(out), *cases)
    assert result.returncode == 0, "the fault worker failed (its output is above)"
    return out, result.stdout


def tensors(path):
    """Every tensor in a checkpoint file, by its place in the nested state."""

    def walk(obj, key):
        if torch.is_tensor(obj):
            yield key, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from walk(v, f"{key}/{k}")
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                yield from walk(v, f"{key}/{i}")

    return dict(walk(torch.load(path, weights_only=False), ""))


def same_state(a, b):
    first, second = tensors(a), tensors(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.slow
@pytest.mark.parametrize("case", SKIP_CASES)
def test_skip_leaves_weights_and_optimizer_state_as_they_were(skip_runs, case):
    out, stdout = skip_runs
    save = out / case
    records = jsonl(save / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2]["skipped"] is True and records[2]["nonfinite"] == expected_message(case)
    assert f"step 3: skipped: {expected_message(case)}" in stdout
    healthy = records[:2] + records[3:]
    assert not any("skipped" in r for r in healthy) and all(math.isfinite(r["loss"]) for r in healthy)
    assert records[3]["lr"] == records[2]["lr"] != records[4]["lr"]  # the warm-up waited a step
    assert records[3]["alpha"] == records[2]["alpha"] != records[4]["alpha"]  # so did BranchNorm's alpha_t

    files = sorted(p.name for p in (save / "global_step2").glob("*.pt"))
    # Adam's moments are in the optimizer states (ZeRO) or the model states file (no ZeRO)
    assert any("exp_avg_sq" in key for name in files for key in tensors(save / "global_step2" / name))
    for name in files:  # weights and optimizer state after step 3 are those after step 2
        assert same_state(save / "global_step2" / name, save / "global_step3" / name), name
    # and training went on
    assert not same_state(
        save / "global_step3" / "layer_01-model_states.pt", save / "global_step4" / "layer_01-model_states.pt"
    )


def reference_norms(save_dir, overrides, step):
    """Per-layer gradient L2 norms of training step `step` in the single-process model, from the
    weights the pipeline had before it (its checkpoint global_step{step - 1})."""
    cfg = load_config(CONFIG, [*overrides, f"train.save_dir={save_dir}"], world_size=2)
    model = load_reference(save_dir, f"global_step{step - 1}").train()
    accumulation = cfg.deepspeed["gradient_accumulation_steps"]
    data = MicroBatches(build_corpus(cfg), cfg.batch_size, cfg.train.seed, start=(step - 1) * accumulation)
    for _ in range(accumulation):
        (src, prev), target = next(data)
        (label_smoothed_cross_entropy(model(src, prev), target, cfg.train.label_smoothing) / accumulation).backward()
    return {
        name: math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.get_submodule(name).parameters()))
        for name in saved_names(model.cfg)
        if name is not None
    }


@pytest.mark.slow
@pytest.mark.parametrize(("case", "tolerance"), [("zero1", 1e-4), ("zero0", 1e-4), ("zero1_bf16", 1e-2)])
def test_gradient_norms_every_k_steps_equal_single_process_ones(skip_runs, case, tolerance):
    """grad_norm_interval 2: steps 2 and 4 (step 3 went non-finite, but is not due anyway), every layer
    with parameters; step 2's norms are those of the single-process model on the same weights and
    micro-batches (fp32 to 1e-4; bf16 against that fp32 reference, to 1%)."""
    out, _ = skip_runs
    save = out / case
    lines = jsonl(save / GRAD_NORMS_FILE)
    assert [line["step"] for line in lines] == [2, 4]
    expected = reference_norms(save, [*SKIP, *SKIP_CASES[case][1]], step=2)
    assert list(lines[0]["norms"]) == list(expected) and all(v > 0 for v in expected.values())
    assert lines[0]["norms"] == pytest.approx(expected, rel=tolerance)
