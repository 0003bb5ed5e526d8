"""Kill-and-resume: a run killed at every kind of point (a rank or the whole job at a random moment, a
half-written file on either rank, between the manifest and `latest`) ends with exactly the weights of a run
never interrupted, and `latest` never names a broken checkpoint."""

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fathom.common.checkpoint_format import MANIFEST, file_damage, read_manifest
from fathom.common.run_layout import LATEST, latest_tag, linked_best, tag_step
from fathom.pipeline.checkpoint import saving
from fathom.pipeline.safety.signals import RESUMABLE_EXIT
from tests.helpers import ROOT, assert_same_training, free_port, launch, wait_for_release

pytestmark = pytest.mark.slow

WORKER = ROOT / "tests" / "workers" / "crash_train.py"
STEPS = 24  # the killed run: its six launches train about 12 steps, the rest is the resume after the last kill
STOPPED_STEPS = 12  # a stopped run: stopped at step 5 or at its first best, then resumed to the end
OVERRIDES = [
    "pipeline.activation_checkpoint_interval=1",  # its recomputation must redraw the same dropout masks
    "model.encoder_layers=2",
    "model.decoder_layers=2",
    "model.branchnorm.T=20",  # alpha moves on every step of the run
    "train.save_interval=3",
    "train.valid_interval=5",
    "train.log_interval=1",
]


def run_args(save_dir: Path, *overrides: str, steps: int = STEPS) -> list[str]:
    return ["--config", str(ROOT / "ds_configs" / "default.json"), "--override", *OVERRIDES,
            f"train.max_steps={steps}", *overrides, f"train.save_dir={save_dir}", "--resume"]  # fmt: skip


def command(save_dir: Path, port: int, *overrides: str, steps: int = STEPS) -> list[str]:
    """The job under the real launcher, which the kills and stops here are sent through."""
    return [shutil.which("deepspeed"), "--num_gpus", "2", "--master_port", str(port), str(WORKER),
            *run_args(save_dir, *overrides, steps=steps)]  # fmt: skip


def resume(save_dir: Path, *overrides: str, steps: int) -> subprocess.CompletedProcess:
    result = launch(WORKER, *run_args(save_dir, *overrides, steps=steps))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def rank_pids(save_dir: Path) -> dict[int, int]:
    """Global rank -> pid of this run's training processes."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in args]
        if str(WORKER) in text and f"train.save_dir={save_dir}" in text:
            local = [a for a in text if a.startswith("--local_rank=")]
            if local:
                found[int(local[0].split("=")[1])] = int(proc.name)
    return found


def steps_done(save_dir: Path) -> int:
    path = save_dir / "metrics.jsonl"
    return len(re.findall(r'"loss"', path.read_text())) if path.exists() else 0


def assert_latest_whole(save_dir: Path) -> None:
    """What a resume would load: complete, every file at its saved size and checksum."""
    committed = saving.committed_files(save_dir)
    if committed is None:
        assert latest_tag(save_dir) is None
        return
    checkpoint, manifest = committed
    assert manifest["step"] == tag_step(checkpoint.name)
    for name, entry in manifest["files"].items():
        assert file_damage(checkpoint / name, entry, read=True) is None


def remove_shm_segments(port: int) -> None:
    for segment in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        segment.unlink()  # a rank killed before it released its shm segment


def killed_launch(save_dir: Path, kill: str, rng: random.Random) -> str:
    """One launch of the run that dies: by an injected crash (FATHOM_CRASH), which a rank started as the
    launcher starts it meets by itself, or by a SIGKILL from here through the real launcher, which must then
    end every rank. Returns what happened, for the failure message."""
    if kill.startswith("inject "):
        job = launch(WORKER, *run_args(save_dir), env={"FATHOM_CRASH": kill.removeprefix("inject ")})
        remove_shm_segments(job.port)
        assert job.returncode != 0, f"{kill}: the run was not killed\n{job.stdout[-3000:]}"
        return f"{kill}: crashed after {steps_done(save_dir)} logged steps, latest {latest_tag(save_dir)}"
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command(save_dir, port), cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        # A random moment 1-3 steps into this launch: mid-step, mid-save or mid-validation.
        target = steps_done(save_dir) + rng.randint(1, 3)
        deadline = time.monotonic() + 120
        while steps_done(save_dir) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is not None:
            ended = proc.stdout.read()[-4000:]
            pytest.fail(f"{kill}: the run ended ({proc.returncode}) before it was killed\n{ended}")
        if kill == "job":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(rank_pids(save_dir)[int(kill.removeprefix("rank "))], signal.SIGKILL)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in rank_pids(save_dir).values():  # the launcher must not leave a rank behind
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{kill}: rank process {pid} outlived its launcher")
        remove_shm_segments(port)
    wait_for_release(save_dir)
    assert proc.returncode != 0, f"{kill}: the run was not killed\n{output[-3000:]}"
    return f"{kill}: killed after {steps_done(save_dir)} logged steps, latest {latest_tag(save_dir)}"


def test_each_kind_of_kill_resumes_to_the_uninterrupted_weights(tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    result = launch(WORKER, "--config", str(ROOT / "ds_configs" / "default.json"), "--override", *OVERRIDES,
                    f"train.max_steps={STEPS}", f"train.save_dir={uninterrupted}")  # fmt: skip
    assert result.returncode == 0

    rng = random.Random(20261122)
    # Each kind once: a repeat of a kind took the save, commit and resume paths its first time took.
    kills = [
        "inject 1:file:1",  # the launch's first save: half of rank 1's first file
        "rank 1",
        "inject 0:file:4",  # rank 0, a few files in
        "job",
        "inject 0:commit",  # everything written and the manifest too, `latest` not yet moved
        "rank 0",
    ]
    run = tmp_path / "killed"
    history = []
    for kill in kills:
        history.append(killed_launch(run, kill, rng))
        assert_latest_whole(run)
    resume(run, steps=STEPS)
    print("\n".join(history))

    assert_same_training(uninterrupted, run)
    assert not [p.name for p in run.glob("*global_step*") if p.is_dir() and read_manifest(p) is None]


def stopped_job(launch: list[str], ready: Callable[[], bool], sig: signal.Signals) -> tuple[int, str]:
    """Starts the job and sends `sig` to all its processes once `ready()`; returns its exit status and output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(launch, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["Ctrl-C", "SIGTERM to the job", "terminal closed"]
)
def test_a_stopped_run_says_where_and_leaves_nothing_half_made(tmp_path, sig):
    """Ctrl-C (to fathom-launch, which passes it on to the ranks), a scheduler's SIGTERM to every process of
    the job (the launcher's SIGTERM to the ranks follows), or the SIGHUP of a closed terminal: the ranks
    ended at once and lost every step since the last save. Now they save the step they are in and say so
    in one line naming the checkpoint --resume continues from, with no traceback and no heartbeat or
    half-saved checkpoint left; fathom-launch waits for them and ends with 75; --resume finishes the run."""
    save_dir = tmp_path / "run"
    launch = command(save_dir, free_port(), steps=STOPPED_STEPS)
    if sig == signal.SIGINT:  # DeepSpeed's runner prints a KeyboardInterrupt traceback; fathom's front end not
        launch[0:1] = [sys.executable, str(ROOT / "scripts" / "launch.py")]
    status, output = stopped_job(launch, lambda: steps_done(save_dir) >= 5, sig)
    assert status != 0 and "Traceback" not in output, output[-3000:]
    assert sig != signal.SIGINT or status == RESUMABLE_EXIT, output[-3000:]
    stopped = [line for line in output.splitlines() if line.startswith("fathom: stopped")]
    tag = latest_tag(save_dir)
    assert tag == f"global_step{steps_done(save_dir)}", output[-3000:]  # no step lost
    assert len(stopped) == 1 and re.fullmatch(
        rf"fathom: stopped by {sig.name} after step \d+; the same command with --resume continues from {tag}",
        stopped[0],
    ), output[-3000:]
    assert not rank_pids(save_dir) and not list(save_dir.glob("heartbeat-*")), output[-3000:]
    assert_latest_whole(save_dir)
    assert all(read_manifest(path) for path in save_dir.glob("global_step*")), "a half-saved checkpoint"
    wait_for_release(save_dir)
    resume(save_dir, steps=STOPPED_STEPS)
    assert steps_done(save_dir) == STOPPED_STEPS


@pytest.mark.parametrize("made", [True, False], ids=["save_dir made by the run", "save_dir there before"])
def test_a_stop_after_a_validated_best_saves_beside_it_and_resume_continues(tmp_path, made):
    """With train.valid_interval below train.save_interval, a SIGTERM after the first `best` but before the
    first global_stepN printed `no checkpoint was saved yet, so RUN was removed again` and deleted the
    save_dir, `best` included (in a save_dir there before, it kept the directory but printed the same).
    Now the stop saves the step it stopped after; `best` stays, and --resume goes on from the stop."""
    save_dir = tmp_path / "run"
    if not made:
        save_dir.mkdir()
        (save_dir / "notes.txt").write_text("mine")
    cadence = ["train.save_interval=1000", "train.valid_interval=2"]  # global_stepN only, at the end
    status, output = stopped_job(command(save_dir, free_port(), *cadence, steps=STOPPED_STEPS),
                                 (save_dir / "best").is_symlink, signal.SIGTERM)  # fmt: skip
    best, step = linked_best(save_dir), steps_done(save_dir)
    assert status != 0 and "Traceback" not in output, output[-3000:]
    assert best and read_manifest(save_dir / best) and latest_tag(save_dir) == f"global_step{step}", output[-3000:]
    stopped = [line for line in output.splitlines() if line.startswith("fathom: stopped")]
    assert stopped == [f"fathom: stopped by SIGTERM after step {step}; the same command with --resume continues "
                       f"from global_step{step}"], output[-3000:]  # fmt: skip
    assert made or (save_dir / "notes.txt").read_text() == "mine"
    wait_for_release(save_dir)
    resumed = resume(save_dir, *cadence, steps=STOPPED_STEPS)
    assert f"resumed from {save_dir}/global_step{step} at step {step}" in resumed.stdout
    assert steps_done(save_dir) == STOPPED_STEPS


def finished_run(save_dir: Path, checkpoints: int) -> None:
    """What a run that saved `checkpoints` checkpoints leaves: its tags, `latest` and records."""
    save_dir.mkdir()
    for step in range(1, checkpoints + 1):
        (save_dir / f"global_step{step}").mkdir()
        (save_dir / f"global_step{step}" / "layer_01-model_states.pt").write_bytes(b"weights")
        (save_dir / f"global_step{step}" / MANIFEST).write_text("{}")
    (save_dir / LATEST).write_text(f"global_step{checkpoints}")
    (save_dir / "metrics.jsonl").write_text('{"step": 1}\n')


def test_a_run_stopped_before_its_first_checkpoint_saves_one_and_keeps_the_run_beside_it(tmp_path):
    """Run A (train.save_dir=P/expA, P made by A) stopped by SIGTERM before its first checkpoint, after run B
    had saved 3 checkpoints in P/expB: A printed `no checkpoint was saved yet, so P was removed again`, and
    its logged steps and B's run went with P. A stop now saves first: A resumes from the step it stopped
    after, with every logged step kept, and B is untouched."""
    parent = tmp_path / "p1"
    stopped, beside = parent / "expA", parent / "expB"
    never_saves = ["train.save_interval=100000", "train.valid_interval=0"]
    launch = command(stopped, free_port(), "pipeline.stages=1", *never_saves, steps=100000)
    launch[launch.index("--num_gpus") + 1] = "1"  # the cheapest run

    def beside_finished() -> bool:  # once A trains, B has saved its checkpoints beside it
        if steps_done(stopped) < 1:
            return False
        finished_run(beside, checkpoints=3)
        return True

    status, output = stopped_job(launch, beside_finished, signal.SIGTERM)
    assert "Traceback" not in output, output[-3000:]
    assert beside.exists() and latest_tag(beside) == "global_step3", output[-3000:]
    assert sorted(p.name for p in parent.iterdir()) == ["expA", "expB"]
    lines = [line for line in output.splitlines() if line.startswith("fathom: stopped")]
    step = steps_done(stopped)
    assert step >= 1 and latest_tag(stopped) == f"global_step{step}", output[-3000:]
    assert lines == [f"fathom: stopped by SIGTERM after step {step}; the same command with --resume continues from "
                     f"global_step{step}"], output[-3000:]  # fmt: skip
