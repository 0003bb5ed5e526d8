"""Elastic resume: a checkpoint resumed on another stage count, replica count or partition carries every
parameter's fp32 master weight, Adam moments and step bit for bit, and the run goes on as if never
interrupted (losses within 1e-5 relative in fp32; summation order changes with the shape, so not bitwise)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fathom.pipeline.checkpoint.reshape as reshape
from fathom.common.checkpoint_format import (
    MANIFEST,
    OPTIMIZER_FILE,
    deepspeed_state_types,
    load_file,
    manifest_files,
    read_manifest,
)
from fathom.common.errors import exit_on_config_error
from fathom.common.run_layout import UNIVERSAL, latest_step
from fathom.pipeline.checkpoint.reshape import Shape
from tests.helpers import ROOT, built_once, launch, launch_env, launcher_command, logged_steps, wait_for_release

DEFAULT = ROOT / "ds_configs" / "default.json"
WORKER = ROOT / "tests" / "workers" / "reshaped_state.py"
# Dropout stays on: its masks depend on (seed, micro-batch, layer), not on a rank (pipeline/engine/recompute.py).
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


def train_args(shape: str, run: Path, *overrides: str) -> list[str]:
    return ["--config", str(DEFAULT), "--override", *SMALL, *SHAPES[shape][1], f"train.save_dir={run}", *overrides]


def train_command(shape: str, run: Path, *overrides: str) -> list[str]:
    """The job under the real launcher, for a test that kills it whole."""
    args = train_args(shape, run, *overrides)
    return launcher_command(ROOT / "scripts" / "train.py", *args, processes=SHAPES[shape][0])


def train(shape: str, run: Path, *overrides: str) -> str:
    result = launch(ROOT / "scripts" / "train.py", *train_args(shape, run, *overrides), processes=SHAPES[shape][0])
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
                param = {key: torch.cat(slices).view(shape) for key, slices in pieces[name].items() if key != "step"}
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

    def train_both(root: Path) -> None:
        for precision in ("fp32", "bf16"):
            train("2x1", root / precision, "train.max_steps=3", "train.save_interval=3",
                  f"bf16.enabled={str(precision == 'bf16').lower()}")  # fmt: skip

    return built_once(tmp_path_factory, "reshape_trained", train_both)


@pytest.mark.slow
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
    wait_for_release(run)


@pytest.mark.slow
def test_a_killed_run_resumed_on_each_new_shape_follows_the_uninterrupted_run(tmp_path):
    """2x1, killed, then --resume as 1x2 (2 -> 1 stages, 1 -> 2 replicas), 3x1 (1 -> 3 stages, 2 -> 1
    replicas), then 2x1 cut by decoder layers instead of by cost (3 -> 2 stages, other cuts), on to step 10:
    a state lost in a reshape shows in the next step's loss."""
    steps = 10
    full, cut = tmp_path / "full", tmp_path / "cut"
    train("2x1", full, f"train.max_steps={steps}", f"train.save_interval={steps}")
    kill_after_step(train_command("2x1", cut, f"train.max_steps={steps}", "train.save_interval=2"), cut, 3)
    step = latest_step(cut)
    assert step >= 2
    for shape in ("1x2", "3x1", "2x1 by decoder layers"):
        step = step + 1 if shape != "2x1 by decoder layers" else steps
        out = train(shape, cut, f"train.max_steps={step}", "train.save_interval=1", "--resume")
        assert "fathom: resuming global_step" in out, out
    differences = relative_differences(full, cut)
    print(f"largest relative loss difference: {max(differences.values()):.1e}")
    assert max(differences.values()) <= TOLERANCE, differences
    assert not list(cut.glob(f"*{UNIVERSAL}")), "the universal copies outlived the next checkpoint"
    left = [p.name for p in cut.iterdir() if p.name == "latest_universal" or p.name.endswith(".tmp")]
    assert not left, "the conversions left their scratch behind"


@pytest.mark.slow
def test_a_bf16_run_resumed_on_another_shape_follows_the_uninterrupted_run(trained, tmp_path):
    full, run = tmp_path / "full", tmp_path / "run"
    train("2x1", full, "train.max_steps=6", "train.save_interval=6", "bf16.enabled=true")
    shutil.copytree(trained / "bf16", run)
    out = train("1x2", run, "train.max_steps=6", "train.save_interval=6", "bf16.enabled=true", "--resume")
    assert "resuming global_step3 written as 2 stages x 1 replica as 1 stage x 2 replicas" in out
    differences = relative_differences(full, run)
    assert max(differences.values()) <= BF16_TOLERANCE, differences


# Converting without the converter: convert() and prepare_reshape() on global rank 0, on a checkpoint that
# has the files they read themselves (the converter is faked, or a small script).


@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict]:
    """A committed 2-stage checkpoint as convert() sees it: two 1 MB optimizer files, two 4 kB model-states
    files and a layer file of 3 tensors; its universal copy needs about 2 x 2 MB + 8 kB + 3 x 44 KiB."""
    checkpoint = tmp_path / "run" / "global_step3"
    checkpoint.mkdir(parents=True)
    torch.save({"weight": torch.ones(4, 4), "bias": torch.ones(4), "omega": torch.ones(1)},
               checkpoint / "layer_01-model_states.pt")  # fmt: skip
    for stage in range(2):
        (checkpoint / f"zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt").write_bytes(bytes(1_000_000))
        (checkpoint / f"mp_rank_{stage:02d}_model_states.pt").write_bytes(bytes(4_000))
    manifest = {"tag": checkpoint.name, "step": 3, "shape": Shape(2, 1, (0, 3, 6)).record(),
                "files": manifest_files(checkpoint)}  # fmt: skip
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return checkpoint, manifest


@pytest.fixture
def rank0(monkeypatch) -> None:
    """prepare_reshape on global rank 0 of a 1 stage x 2 replicas launch, its broadcast to itself, 2 cores."""
    monkeypatch.setattr(reshape.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(reshape.dist, "broadcast_object_list", lambda objects, src: None)
    monkeypatch.setattr(reshape, "engine_shape", lambda engine: Shape(1, 2, (0, 6)))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


def free_space(monkeypatch, *free: int) -> None:
    """The space the file systems have free, at each look in turn (then as at the last)."""
    looks = iter(free)

    def disk_usage(path) -> SimpleNamespace:
        return SimpleNamespace(free=next(looks, free[-1]))

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def mount(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def resume_error(checkpoint: Path, manifest: dict, capsys) -> tuple[int, list[str]]:
    """The exit status and stderr lines of a resume whose reshape fails, as scripts/train.py ends."""
    with pytest.raises(SystemExit) as exited, exit_on_config_error():
        reshape.prepare_reshape(None, checkpoint, manifest)
    return exited.value.code, capsys.readouterr().err.splitlines()


def test_a_disk_too_full_for_the_universal_copy_is_one_line_before_converting(saved, rank0, monkeypatch, capsys):
    """With 1.5 MB free the converter failed in torch's zip writer, and the line said to give up the reshape.
    What a conversion killed with its job left (its scratch folder, a copy without a manifest) goes first."""
    checkpoint, manifest = saved
    for left in (f".global_step3{UNIVERSAL}.0123456789ab.tmp/global_step3{UNIVERSAL}/zero", f"global_step3{UNIVERSAL}"):
        (checkpoint.parent / left).mkdir(parents=True)
    free_space(monkeypatch, 1_500_000)
    status, lines = resume_error(checkpoint, manifest, capsys)  # a converter started would fail the test
    assert status == 1 and lines == [
        f"fathom: error: no space left on {mount(checkpoint)}: the universal copy of global_step3 needs about "
        "4.1 MB, 1.5 MB free; free space and run the same command again"
    ]
    assert [path.name for path in checkpoint.parent.iterdir()] == ["global_step3"]


def failing_converter(returncode: int, stderr: str):
    """subprocess.run for a converter that writes part of its output, then fails."""

    def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
        out = Path(command[command.index("--output_folder") + 1])
        (out / "zero" / "decoder.weight").mkdir(parents=True)
        (out / "zero" / "decoder.weight" / "fp32.pt").write_bytes(b"part of a file")
        return subprocess.CompletedProcess(command, returncode, "", f"Traceback (most recent call last):\n{stderr}\n")

    return run


OPTIMIZER = "{checkpoint}/zero_pp_rank_0_mp_rank_00_optim_states.pt"
OOM = ("while converting global_step3 for the new shape; its 2 workers read up to about 2.0 MB of optimizer state "
       "at once: free memory and run the same command again")  # fmt: skip
GENERIC = "; resume on the shape it was saved in (2 stages x 1 replica), which needs no conversion"
CONVERTER_FAILURES = {
    "torch's writer on a full disk": (
        1, "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", 1,
        "no space left on {mount}: DeepSpeed's ds_to_universal could not write the universal copy of global_step3 "
        "(RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598); it needs about "
        "4.1 MB, 3.0 MB free; free space and run the same command again",
    ),
    "a directory on a full disk": (
        1, "OSError: [Errno 28] No space left on device: '/x/zero/decoder.weight'", 1,
        "no space left on {mount}: DeepSpeed's ds_to_universal could not write the universal copy of global_step3 "
        "(OSError: [Errno 28] No space left on device: '/x/zero/decoder.weight'); it needs about 4.1 MB, 3.0 MB "
        "free; free space and run the same command again",
    ),
    "a write failing with the space there": (
        1, "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", 1,
        "DeepSpeed's ds_to_universal could not write the universal copy of global_step3 on {mount} (RuntimeError: "
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598), which needs about 4.1 MB with 5.0 "
        "MB free now: a disk quota, a file size limit (ulimit -f) or another writer filling the disk; lift it or "
        "free space and run the same command again",
    ),
    "killed by the out-of-memory killer": (
        -signal.SIGKILL, "", 2,
        "--resume: DeepSpeed's ds_to_universal was killed by SIGKILL, most likely by the kernel's out-of-memory "
        f"killer, {OOM}",
    ),
    "a worker killed": (
        1, "concurrent.futures.process.BrokenProcessPool: A process in the process pool was terminated abruptly "
        "while the future was running or pending.", 2,
        f"--resume: DeepSpeed's ds_to_universal had a worker killed, most likely by the kernel's out-of-memory "
        f"killer, {OOM}",
    ),
    "out of memory": (1, "MemoryError", 2, f"--resume: DeepSpeed's ds_to_universal ran out of memory, {OOM}"),
    "a file it may not read": (
        1, f"PermissionError: [Errno 13] Permission denied: '{OPTIMIZER}'", 1,
        f"{OPTIMIZER}: Permission denied (DeepSpeed's ds_to_universal, converting global_step3 for the new shape); "
        "make the file readable or restore it, and run the same command again",
    ),
    "a file the disk cannot read": (
        1, f"OSError: [Errno 5] Input/output error: '{OPTIMIZER}'", 1,
        f"{OPTIMIZER}: Input/output error (DeepSpeed's ds_to_universal, converting global_step3 for the new "
        "shape); make the file readable or restore it, and run the same command again",
    ),
    "a file that does not unpickle": (
        1, "_pickle.UnpicklingError: invalid load key, '\\x00'.", 2,
        "--resume: DeepSpeed's ds_to_universal could not read a file of {checkpoint} (_pickle.UnpicklingError: "
        "invalid load key, '\\x00'.); it passed its checksums, so it changed since or DeepSpeed cannot read it: "
        "restore it from a copy, or resume on the shape it was saved in (2 stages x 1 replica)",
    ),
    "a crash": (-signal.SIGSEGV, "", 2,
                "--resume: DeepSpeed's ds_to_universal could not convert {checkpoint} (ended by SIGSEGV)" + GENERIC),
    "an unknown failure": (
        1, "ValueError: Cannot parse dp_rank from x", 2,
        "--resume: DeepSpeed's ds_to_universal could not convert {checkpoint} (ValueError: Cannot parse dp_rank "
        "from x)" + GENERIC,
    ),
}  # fmt: skip


# the cases where the converter filled the disk: less is free when it fails than when it started
FILLED = {"torch's writer on a full disk": 3_000_000, "a directory on a full disk": 3_000_000}


@pytest.mark.parametrize("case", CONVERTER_FAILURES)
def test_a_converter_failure_is_named_for_what_it_is_and_leaves_nothing(saved, rank0, monkeypatch, capsys, case):
    """Every failure of the converter used to say `could not convert ... (its last line); resume on the shape
    it was saved in`, a full disk too; now each is one line naming the cause and its fix, exit 1 for a file
    the system cannot write or read, and the part of the universal copy it wrote is removed."""
    checkpoint, manifest = saved
    returncode, stderr, status, line = CONVERTER_FAILURES[case]
    monkeypatch.setattr(subprocess, "run", failing_converter(returncode, stderr.format(checkpoint=checkpoint)))
    free_space(monkeypatch, 5_000_000, FILLED.get(case, 5_000_000))  # enough to start by the estimate
    got, lines = resume_error(checkpoint, manifest, capsys)
    want = "fathom: error: " + line.format(mount=mount(checkpoint), checkpoint=checkpoint)
    assert (got, lines) == (status, [want])
    assert [path.name for path in checkpoint.parent.iterdir()] == ["global_step3"]


def test_a_resume_that_reuses_a_universal_copy_says_so(saved, rank0):
    """It said `converted to DeepSpeed's universal form in 0.0 s` of a copy an earlier resume converted."""
    checkpoint, manifest = saved
    universal = checkpoint.with_name(f"global_step3{UNIVERSAL}")
    universal.mkdir()
    torch.save({"fp32": torch.ones(2)}, universal / "fp32.pt")
    (universal / MANIFEST).write_text(json.dumps({**manifest, "files": manifest_files(universal)}))
    assert reshape.prepare_reshape(None, checkpoint, manifest) == (
        f"global_step3{UNIVERSAL}",
        "global_step3 written as 2 stages x 1 replica as 1 stage x 2 replicas; reused its universal form, "
        f"converted by an earlier resume (global_step3{UNIVERSAL})",
    )


@pytest.mark.slow
def test_a_converter_killed_by_a_signal_says_so_and_leaves_nothing(saved, rank0, monkeypatch, capsys):
    """A real process: the converter's return code is the negative signal number when it is killed."""
    checkpoint, manifest = saved
    script = ("import os, pathlib, signal, sys; out = pathlib.Path(sys.argv[1]); out.mkdir(); "
              "(out / 'fp32.pt').write_bytes(b'part'); os.kill(os.getpid(), signal.SIGKILL)")  # fmt: skip
    monkeypatch.setattr(reshape, "converter_command", lambda checkpoint, out: [sys.executable, "-c", script, str(out)])
    status, lines = resume_error(checkpoint, manifest, capsys)
    assert status == 2 and lines == [
        f"fathom: error: --resume: DeepSpeed's ds_to_universal was killed by SIGKILL, most likely by the kernel's "
        f"out-of-memory killer, {OOM}"
    ]
    assert [path.name for path in checkpoint.parent.iterdir()] == ["global_step3"]
