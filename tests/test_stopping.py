"""Stop = save: every stop signal, a wall-clock limit and a launcher's end make the ranks save the step they are
in and exit with 75; a second signal ends them at once with `latest` still whole; a rank that never joins
or dies mid-job is one line naming it. Each case was a defect of a run on a cluster (issue 62)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fathom.common.run_layout import latest_tag
from fathom.pipeline.safety.signals import ECHO_S, RESUMABLE_EXIT
from fathom.pipeline.safety.watchdog import read_heartbeat
from tests.helpers import ROOT, Job, assert_same_training, free_port, launch, wait_for_release
from tests.test_crash import OVERRIDES, WORKER, assert_latest_whole, steps_done

pytestmark = pytest.mark.slow

STEPS = 12


def args(save_dir: Path, *overrides: str, steps: int = STEPS) -> list[str]:
    return ["--config", str(ROOT / "ds_configs" / "default.json"), "--override", *OVERRIDES,
            f"train.max_steps={steps}", *overrides, f"train.save_dir={save_dir}", "--resume"]  # fmt: skip


def heartbeat_pids(save_dir: Path) -> list[int]:
    """The training ranks' pids, as their heartbeats name them (a warm rank's command line is its server's)."""
    beats = [read_heartbeat(path) for path in sorted(save_dir.glob("heartbeat-rank*.json"))]
    return [beat.pid for beat in beats if beat is not None]


def launched_in_background(
    save_dir: Path, *overrides: str, steps: int = STEPS, env=None
) -> tuple[threading.Thread, list]:
    """A 2-rank job (warm ranks) in a thread; the list gets its Job once it has ended."""
    ended: list[Job] = []
    job = threading.Thread(target=lambda: ended.append(launch(WORKER, *args(save_dir, *overrides, steps=steps),
                                                              env=env)))  # fmt: skip
    job.start()
    return job, ended


def wait_for(ready, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def signal_ranks(save_dir: Path, sig: signal.Signals) -> None:
    for pid in heartbeat_pids(save_dir):
        os.kill(pid, sig)


def stop_line(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("fathom: stopped")]


def test_a_schedulers_warning_saves_the_step_and_the_resumed_run_is_the_uninterrupted_one(tmp_path):
    """SIGUSR1, which `sbatch --signal=USR1@120` sends the tasks ahead of a time limit, killed each rank with no
    message and no save. Now the ranks save the step they are in, say so, and exit with 75; resumed, the run
    ends bit-equal to one never stopped, no step trained twice."""
    uninterrupted = tmp_path / "uninterrupted"
    assert launch(WORKER, *args(uninterrupted)).returncode == 0
    run = tmp_path / "run"
    job, ended = launched_in_background(run)
    wait_for(lambda: steps_done(run) >= 4 and len(heartbeat_pids(run)) == 2)
    signal_ranks(run, signal.SIGUSR1)
    job.join()
    (stopped,) = ended
    step = steps_done(run)
    assert stopped.returncode == RESUMABLE_EXIT and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert stop_line(stopped.stderr) == [f"fathom: stopped by SIGUSR1 after step {step}; the same command with "
                                         f"--resume continues from global_step{step}"]  # fmt: skip
    assert latest_tag(run) == f"global_step{step}" and step < STEPS
    wait_for_release(run)
    resumed = launch(WORKER, *args(run))
    assert f"resumed from {run}/global_step{step} at step {step}" in resumed.stdout
    assert_same_training(uninterrupted, run)


def test_a_signal_during_a_save_lets_it_finish_and_a_second_one_ends_at_once(tmp_path):
    """A stop signal during a checkpoint save threw the save away (every rank ended at once). Now the save in
    progress completes and is the one --resume continues from. A second signal, later than a launcher's echo
    of the first, ends the ranks at once: the save it cuts is removed and `latest` stays whole."""
    run = tmp_path / "run"
    slow = {"FATHOM_SLOW_SAVE": "3"}
    job, ended = launched_in_background(run, env=slow)
    wait_for(lambda: (run / "saving-global_step3").exists())
    signal_ranks(run, signal.SIGTERM)
    job.join()
    (stopped,) = ended
    assert stopped.returncode == RESUMABLE_EXIT, stopped.stderr[-3000:]
    assert latest_tag(run) == "global_step3" and steps_done(run) == 3, stopped.stderr[-3000:]
    assert stop_line(stopped.stderr) == ["fathom: stopped by SIGTERM after step 3; the same command with --resume "
                                         "continues from global_step3"]  # fmt: skip

    wait_for_release(run)
    job, ended = launched_in_background(run, env={"FATHOM_SLOW_SAVE": "8"})
    wait_for(lambda: steps_done(run) >= 4 and len(heartbeat_pids(run)) == 2)
    signal_ranks(run, signal.SIGTERM)  # the stop's save (after step 4 or 5) waits 8 s: signal again meanwhile
    wait_for(lambda: any(run.glob("saving-global_step[45]")))
    time.sleep(ECHO_S + 0.5)
    signal_ranks(run, signal.SIGTERM)
    job.join()
    (ended_at_once,) = ended
    assert ended_at_once.returncode == 128 + signal.SIGTERM, ended_at_once.stderr[-3000:]
    assert re.search(r"fathom: stopped by SIGTERM again after step \d+; the same command with --resume continues "
                     "from global_step3", ended_at_once.stderr), ended_at_once.stderr[-3000:]  # fmt: skip
    assert latest_tag(run) == "global_step3" and not (run / "global_step4").exists()
    assert_latest_whole(run)


def test_a_wall_clock_limit_saves_and_exits_75(tmp_path):
    """fairseq's --stop-time-hours and Megatron's --exit-duration-in-mins: train.exit_after_minutes stops the run
    with a save before a scheduler's time limit would kill it."""
    run = tmp_path / "run"
    job = launch(WORKER, *args(run, "train.exit_after_minutes=0.15", steps=100000))
    step = steps_done(run)
    assert job.returncode == RESUMABLE_EXIT and step > 0, job.stderr[-3000:]
    assert stop_line(job.stderr) == [f"fathom: stopped by train.exit_after_minutes (0.15) after step {step}; the same "
                                     f"command with --resume continues from global_step{step}"]  # fmt: skip


def training(save_dir: Path) -> bool:
    """Whether a rank of the run in save_dir still runs, however it was launched."""
    return subprocess.run(["pgrep", "-f", f"train.save_dir={save_dir} "], capture_output=True).returncode == 0


LAUNCHERS = {
    "deepspeed": ["deepspeed", "--num_gpus", "2"],
    "fathom-launch": [sys.executable, str(ROOT / "scripts" / "launch.py"), "--num_gpus", "2"],
    "torchrun": ["torchrun", "--nproc_per_node", "2"],  # it hosts the rendezvous store the ranks join
}


@pytest.mark.parametrize("front", list(LAUNCHERS))
def test_sigterm_to_the_launcher_alone_stops_every_rank_after_a_save(tmp_path, front):
    """`kill PID` of `deepspeed` (or scripts/launch.py) exited 143 while both ranks kept training (they reached
    step 1209). Now the ranks see their launcher end (or fathom-launch and torchrun pass the signal on), save
    and exit; fathom-launch waits for them and ends with their 75."""
    run = tmp_path / "run"
    command = [*LAUNCHERS[front], "--master_port", str(free_port()), str(WORKER), *args(run, steps=100000)]
    launcher = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_for(lambda: steps_done(run) >= 3)
        launcher.terminate()  # that process alone, not its group
        output, _ = launcher.communicate(timeout=120)
        wait_for(lambda: not training(run), timeout=60)
    finally:
        launcher.kill()
        subprocess.run(["pkill", "-9", "-f", f"train.save_dir={run} "])
    step = steps_done(run)
    assert latest_tag(run) == f"global_step{step}", output[-3000:]
    if front == "fathom-launch":
        assert launcher.returncode == RESUMABLE_EXIT, output[-3000:]
        assert stop_line(output) == [f"fathom: stopped by SIGTERM after step {step}; the same command with "
                                     f"--resume continues from global_step{step}"]  # fmt: skip


def test_a_rank_that_never_joins_is_named_within_the_startup_timeout(tmp_path):
    """A node that could not start its rank (no virtualenv there: exit 127) left the others waiting until
    killed. Now rank 0 names the ranks that never joined after train.startup_timeout and exits 2."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    started = time.monotonic()
    alone = subprocess.run([sys.executable, "-u", str(WORKER), *args(tmp_path / "run", "train.startup_timeout=10")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert alone.returncode == 2 and time.monotonic() - started < 120, alone.stderr[-3000:]
    errors = [line for line in alone.stderr.splitlines() if line.startswith("fathom: error")]
    assert errors == [line for line in errors if "rank 1 of 2 never joined within 10 s (train.startup_timeout)" in line]
    assert len(errors) == 1 and not (tmp_path / "run").exists(), alone.stderr[-3000:]


def test_a_peer_that_dies_is_one_line_on_the_survivor(tmp_path):
    """A rank killed mid-job left its peer a 30-line traceback from gloo (`Connection reset by peer` inside a
    barrier). Now the survivor prints one line naming the dead rank and the checkpoint to resume from."""
    run = tmp_path / "run"
    job, ended = launched_in_background(run, steps=100000)
    wait_for(lambda: latest_tag(run) == "global_step3" and len(heartbeat_pids(run)) == 2)
    dead = read_heartbeat(run / "heartbeat-rank1.json").pid
    os.kill(dead, signal.SIGKILL)
    job.join()
    (failed,) = ended
    assert failed.returncode != 0 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("fathom: error")]
    assert len(errors) == 1 and re.fullmatch(
        rf"fathom: error: rank 0: lost rank 1 \(pid {dead}\), so the job ends \(.*by peer.*\); the same command "
        r"with --resume continues from global_step\d+", errors[0]), failed.stderr[-3000:]  # fmt: skip
