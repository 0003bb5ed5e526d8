"""Elastic resume: a checkpoint resumed on another stage count, replica count or partition carries every
parameter's fp32 master weight, Adam moments and step bit for bit, and the run goes on as if never
interrupted (losses within 1e-5 relative in fp32; summation order changes with the shape, so not bitwise)."""

import json
import os
import shutil
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from common.run_layout import deepspeed_state_types, latest_step, load_file, read_manifest
from pipeline.checkpoint.reshape import OPTIMIZER_FILE, UNIVERSAL
from tests.helpers import ROOT, launch, launch_env, launcher_command, logged_steps

pytestmark = pytest.mark.slow

DEFAULT = ROOT / "ds_configs" / "default.json"
WORKER = ROOT / "tests" / "workers" / "reshaped_state.py"
# Dropout stays on: its masks depend on (seed, micro-batch, layer), not on a rank (pipeline/dropout_masks.py).
SMALL = ["model.encoder_layers=2", "model.decoder_layers=2", "model.share_all_embeddings=true", "train.log_interval=1"]
# (stages, processes, overrides): the global batch stays 32 pairs, 4 micro-batches of 8, on every shape.
SHAPES = {
    "2x1": (2, ["pipeline.stages=2", "gradient_accumulation_steps=4"]),
    "1x2": (2, ["pipeline.stages=1", "gradient_accumulation_steps=2"]),
    "3x1": (3, ["pipeline.stages=3", "gradient_accumulation_steps=4"]),
    # the cost partition cuts 2 stages before the decoder embedding, this one after the first decoder layer
    "2x1 by decoder layers": (
        2,
        ["pipeline.stages=2", "gradient_accumulation_steps=4", "pipeline.partition=type:DecoderLayerPipe"],
    ),  # fmt: skip
}
TOLERANCE = 1e-5  # relative, fp32
BF16_TOLERANCE = 1e-4  # relative: gradients summed in another order in bf16


def train_command(shape: str, run: Path, *overrides: str) -> list[str]:
    processes, settings = SHAPES[shape]
    args = ["--config", str(DEFAULT), "--override", *SMALL, *settings, f"train.save_dir={run}", *overrides]
    return launcher_command(ROOT / "scripts" / "train.py", *args, processes=processes)


def train(shape: str, run: Path, *overrides: str) -> str:
    result = subprocess.run(train_command(shape, run, *overrides), cwd=ROOT, env=launch_env(), capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def gathered_state(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's fp32 master weight, exp_avg, exp_avg_sq and Adam step, by its name, put back
    together from the checkpoint's ZeRO partitions (one file per stage and replica) without DeepSpeed."""
    ranks: dict[int, dict[int, dict]] = defaultdict(dict)
    for path in checkpoint.glob("*zero_pp_rank_*_optim_states.pt"):
        replica, stage = map(int, OPTIMIZER_FILE.fullmatch(path.name).groups())
        ranks[stage][replica] = load_file(path, allowed=deepspeed_state_types())["optimizer_state_dict"]
    gathered: dict[str, dict[str, torch.Tensor]] = {}
    for stage, partitions in ranks.items():
        shapes = load_file(checkpoint / f"mp_rank_{stage:02d}_model_states.pt", allowed=deepspeed_state_types())
        for group, names in enumerate(shapes["param_shapes"]):
            pieces: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
            for replica in sorted(partitions):
                state = partitions[replica]
                adam = state["base_optimizer_state"]["state"][group]
                flat = {"fp32": state["single_partition_of_fp32_groups"][group], "exp_avg": adam["exp_avg"],
                        "exp_avg_sq": adam["exp_avg_sq"]}  # fmt: skip
                for name, address in state["param_slice_mappings"][group].items():
                    for key, tensor in flat.items():
                        pieces[name][key].append(tensor.narrow(0, address.start, address.numel))
                    pieces[name]["step"] = [adam["step"]]
            for name, shape in names.items():
                param = {key: torch.cat(parts).view(shape) for key, parts in pieces[name].items() if key != "step"}
                param["step"] = pieces[name]["step"][0]
                if name in gathered:  # a tied table: each stage holding it keeps the same state
                    assert all(torch.equal(param[key], gathered[name][key]) for key in param), name
                gathered[name] = param
    return gathered


def layer_weights(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {path.name: load_file(path) for path in sorted(checkpoint.glob("layer_*-model_states.pt"))}


def counters(checkpoint: Path) -> dict:
    states = load_file(checkpoint / "mp_rank_00_model_states.pt", allowed=deepspeed_state_types())
    keys = ("global_steps", "skipped_steps", "global_samples", "lr_scheduler", "schedule_offset")
    return {key: states[key] for key in keys}


def dir_digest(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """3 steps at 2 stages x 1 replica, in fp32 and bf16, checkpointed at step 3."""
    root = tmp_path_factory.mktemp("reshape")
    for precision in ("fp32", "bf16"):
        train("2x1", root / precision, "train.max_steps=3", "train.save_interval=3",
              f"bf16.enabled={str(precision == 'bf16').lower()}")  # fmt: skip
    return root


@pytest.mark.parametrize("precision, shape", [("fp32", "1x2"), ("fp32", "3x1"), ("bf16", "1x2")])
def test_a_reshaped_checkpoint_holds_the_same_state(trained, tmp_path, precision, shape):
    run = tmp_path / "run"
    shutil.copytree(trained / precision, run)
    original = run / "global_step3"
    before = dir_digest(original)
    processes, settings = SHAPES[shape]
    overrides = [*SMALL, *settings, f"train.save_dir={run}", f"bf16.enabled={str(precision == 'bf16').lower()}"]
    result = launch(WORKER, str(DEFAULT), str(tmp_path / "out"), str(processes), *overrides, processes=processes)
    assert result.returncode == 0
    assert f"resuming global_step3 written as 2 stages x 1 replica as {shape[0]} stage" in result.stdout
    assert dir_digest(original) == before, "the reshape changed the original checkpoint"
    universal = run / f"global_step3{UNIVERSAL}"
    assert read_manifest(universal)["source"] == "global_step3"

    reshaped = tmp_path / "out" / "global_step3"
    assert read_manifest(reshaped)["shape"]["stages"] == int(shape[0])
    want, got = gathered_state(original), gathered_state(reshaped)
    assert got.keys() == want.keys() and "tied_modules.embed.weight" in got
    for name, state in want.items():
        for key, tensor in state.items():
            assert torch.equal(got[name][key], tensor), f"{name} {key}"
    assert counters(reshaped) == counters(original)
    want_layers, got_layers = layer_weights(original), layer_weights(reshaped)
    assert got_layers.keys() == want_layers.keys()
    for file, tensors in want_layers.items():
        assert all(torch.equal(got_layers[file][key], tensor) for key, tensor in tensors.items()), file


def relative_differences(expected: Path, actual: Path) -> dict[int, float]:
    want = {record["step"]: record for record in logged_steps(expected) if "loss" in record}
    got = {record["step"]: record for record in logged_steps(actual) if "loss" in record}
    assert got.keys() == want.keys()
    return {step: abs(got[step]["loss"] - want[step]["loss"]) / abs(want[step]["loss"]) for step in want}


def kill_after_step(command: list[str], run: Path, step: int) -> None:
    """Starts a launch and SIGKILLs its whole process group once metrics.jsonl has logged `step`."""
    process = subprocess.Popen(command, cwd=ROOT, env=launch_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            break
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_a_killed_run_resumed_on_each_new_shape_follows_the_uninterrupted_run(tmp_path):
    """2x1, killed, then --resume as 1x2 (2 -> 1 stages, 1 -> 2 replicas), 2x1 (1 -> 2 stages, 2 -> 1
    replicas), 3x1 (2 -> 3), 2x1 (3 -> 2), then 2x1 cut by decoder layers instead of by cost (the same stage
    count), 20 steps on from there."""
    steps = 25
    full, cut = tmp_path / "full", tmp_path / "cut"
    train("2x1", full, f"train.max_steps={steps}", f"train.save_interval={steps}")
    kill_after_step(train_command("2x1", cut, f"train.max_steps={steps}", "train.save_interval=2"), cut, 3)
    step = latest_step(cut)
    assert step >= 2
    for shape in ("1x2", "2x1", "3x1", "2x1", "2x1 by decoder layers"):
        step = step + 1 if shape != "2x1 by decoder layers" else steps
        out = train(shape, cut, f"train.max_steps={step}", "train.save_interval=1", "--resume")
        assert "fathom: resuming global_step" in out, out
    differences = relative_differences(full, cut)
    assert max(differences.values()) <= TOLERANCE, differences
    assert not list(cut.glob(f"*{UNIVERSAL}")), "the universal copies outlived the next checkpoint"
    left = [p.name for p in cut.iterdir() if p.name == "latest_universal" or p.name.endswith(".tmp")]
    assert not left, "the conversions left their scratch behind"


def test_a_bf16_run_resumed_on_another_shape_follows_the_uninterrupted_run(trained, tmp_path):
    full, run = tmp_path / "full", tmp_path / "run"
    train("2x1", full, "train.max_steps=6", "train.save_interval=6", "bf16.enabled=true")
    shutil.copytree(trained / "bf16", run)
    out = train("1x2", run, "train.max_steps=6", "train.save_interval=6", "bf16.enabled=true", "--resume")
    assert "resuming global_step3 written as 2 stages x 1 replica as 1 stage x 2 replicas" in out
    differences = relative_differences(full, run)
    assert max(differences.values()) <= BF16_TOLERANCE, differences
