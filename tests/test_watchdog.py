"""A hung peer ends the job within train.hang_timeout, naming the rank to blame (pipeline/safety/watchdog.py)."""

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from fathom.common.errors import ConfigError
from fathom.common.run_layout import HEARTBEAT_FILE
from fathom.pipeline.config.run_config import load_config
from fathom.pipeline.safety.peers import gone_peers_within
from fathom.pipeline.safety.watchdog import Heartbeat, Seen, Watchdog, blame, read_heartbeat, watch
from tests.helpers import ROOT, launch_env, launcher_command

SAVE_DIR = Path("/runs/exp")
DEFAULT = ROOT / "ds_configs" / "default.json"


def heartbeat(rank: int, beat: int, progress: int = 5, doing: str = "training step 6") -> Heartbeat:
    return Heartbeat(rank=rank, host=f"node{rank}", pid=100 + rank, beat=beat, progress=progress, doing=doing)


def history(readings: list[dict[int, Heartbeat | None]]) -> dict[int, Seen]:
    """What a rank saw of its peers from one round of readings per second, starting at t = 0."""
    seen: dict[int, Seen] = {}
    for second, reading in enumerate(readings):
        watch(seen, reading, float(second))
    return seen


ME = heartbeat(0, beat=40)


def test_a_peer_whose_heartbeat_stopped_is_blamed_and_a_slow_live_one_is_not():
    # rank 1 froze after t = 3; rank 2 is slow to publish (every 3 s) but alive; 11 readings, t = 0..10
    seen = history([{1: heartbeat(1, min(t, 3)), 2: heartbeat(2, t // 3)} for t in range(11)])
    assert blame(ME, seen, now=10.0, stopped_after=5.0, save_dir=SAVE_DIR) == (
        "rank 1 (host node1, pid 101) stopped responding (heartbeat unchanged for 7 s)"
    )


def test_every_stopped_peer_is_named_with_the_shortest_silence():
    seen = history([{1: heartbeat(1, min(t, 2)), 2: heartbeat(2, t), 3: heartbeat(3, min(t, 4))} for t in range(11)])
    assert blame(ME, seen, now=10.0, stopped_after=5.0, save_dir=SAVE_DIR) == (
        "rank 1 (host node1, pid 101) and rank 3 (host node3, pid 103) stopped responding (heartbeat unchanged for 6 s)"
    )


def test_a_peer_without_a_heartbeat_file_points_at_the_shared_filesystem():
    seen = history([{1: None, 2: heartbeat(2, t)} for t in range(11)])
    assert blame(ME, seen, now=10.0, stopped_after=5.0, save_dir=SAVE_DIR) == (
        "rank 1 (no heartbeat file in /runs/exp; train.save_dir must be on a filesystem all nodes share) "
        "stopped responding"
    )


def test_when_all_are_alive_the_rank_with_fewest_progress_marks_is_blamed():
    saving = "checkpoint save after step 5"
    seen = history([{1: heartbeat(1, t), 2: heartbeat(2, t, progress=4, doing=saving)} for t in range(11)])
    assert blame(ME, seen, now=10.0, stopped_after=5.0, save_dir=SAVE_DIR) == (
        "rank 2 (host node2, pid 102) is alive but stuck in checkpoint save after step 5 while other ranks went further"
    )
    # The watching rank itself can be the one behind.
    seen = history([{1: heartbeat(1, t, progress=6), 2: heartbeat(2, t, progress=6)} for t in range(11)])
    assert blame(ME, seen, now=10.0, stopped_after=5.0, save_dir=SAVE_DIR).startswith(
        "rank 0 (host node0, pid 100) is alive but stuck in training step 6"
    )


def test_all_alive_at_the_same_point_blames_no_rank():
    seen = history([{1: heartbeat(1, t), 2: heartbeat(2, t)} for t in range(11)])
    assert blame(ME, seen, now=10.0, stopped_after=5.0, save_dir=SAVE_DIR) == (
        "all 3 ranks are alive and in training step 6, none behind: they wait on each other"
    )


def test_hang_timeout_is_checked():
    with pytest.raises(ConfigError, match=r"^train.hang_timeout: must be at least 10 seconds, got 5.0$"):
        load_config(DEFAULT, ["train.hang_timeout=5"], world_size=2)
    assert load_config(DEFAULT, world_size=2).train.hang_timeout == 1800


def test_slow_steps_beside_a_live_peer_are_no_hang_and_a_longer_stall_is(tmp_path, monkeypatch):
    """Two watchdogs as ranks 0 and 1 (timeout 4 s, a check every 0.4 s), on a clock the test moves, so
    a loaded machine cannot shift the verdict: rank 0's steps take 3 s, rank 1 never progresses. Rank 1
    blames itself after 4 s; rank 0 only once it stops progressing too, and blames rank 1."""
    ended: list[tuple[int, float, str]] = []
    monkeypatch.setattr(Watchdog, "end_job", lambda self, stalled, culprit: ended.append((self.rank, stalled, culprit)))
    now = 0.0
    watchdogs = [Watchdog(tmp_path, rank, 2, hang_timeout=4) for rank in (0, 1)]
    for watchdog in watchdogs:
        watchdog.clock = lambda: now
        watchdog.mark = (0, "start-up", now)
    for tick in range(1, 31):  # 12 s of checks
        now = tick * watchdogs[0].interval
        if tick in (8, 15):  # steps ending at 3.2 s and 6 s; none after
            watchdogs[0].progress(f"training step {tick // 7 + 1}")
        for watchdog in watchdogs:
            watchdog.publish()
            watchdog.check(now)
    me = f"host {socket.gethostname()}, pid {os.getpid()}"
    first = {rank: (stalled, culprit) for rank, stalled, culprit in reversed(ended)}
    assert first[1] == (4.0, f"rank 1 ({me}) is alive but stuck in start-up while other ranks went further")
    assert first[0][1] == first[1][1] and first[0][0] == pytest.approx(4.0)


def test_a_started_watchdog_beats_and_stop_leaves_no_thread_and_no_file(tmp_path):
    watchdog = Watchdog(tmp_path, 0, 1, hang_timeout=10).start()
    try:
        assert read_heartbeat(watchdog.path(0)).rank == 0
    finally:
        watchdog.stop()
    assert not watchdog.thread.is_alive() and list(tmp_path.iterdir()) == []


HANG = 20


def wait_for_steps(job: subprocess.Popen, metrics: Path, steps: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before step {steps}"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {steps} within 300 s")


def running_in_group(pgid: int, grace: float) -> list[psutil.Process]:
    """The processes of a process group still alive after `grace` seconds. DeepSpeed's launcher SIGKILLs a
    stopped rank and exits without reaping it, so for a moment the rank is dying or a zombie that init reaps;
    neither holds memory or a port, so neither counts."""
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.slow
def test_a_peer_still_dying_when_its_connection_closes_is_named(tmp_path):
    """A SIGKILLed rank's sockets close before its process has ended; the survivor read it as running and
    said "lost a peer rank" (CI, issue 65). It now looks again until the process has ended."""
    dying = subprocess.Popen(["sleep", "1"])
    beat = Heartbeat(rank=1, host=socket.gethostname(), pid=dying.pid, beat=1, progress=3, doing="training step 4")
    (tmp_path / HEARTBEAT_FILE.format(rank=1)).write_text(json.dumps(dataclasses.asdict(beat)))
    try:
        gone = gone_peers_within(tmp_path, rank=0, world_size=2, host=socket.gethostname())
    finally:
        dying.kill()
        dying.wait()
    assert gone == [f"rank 1 (pid {dying.pid})"]


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    """Real launcher, 2 stages: rank 1 paused for less than hang_timeout is waited for; stopped for good,
    the job ends within hang_timeout (+ the launcher's 30 s grace before it SIGKILLs a stopped process),
    with one line naming rank 1, and no process of the job is left."""
    save_dir = tmp_path / "run"
    overrides = [
        f"train.save_dir={save_dir}",
        f"train.hang_timeout={HANG}",
        "train.max_steps=1000000",
        "train.save_interval=1000000",
        "model.encoder_layers=2",
        "model.decoder_layers=2",
    ]
    cmd = launcher_command(ROOT / "scripts" / "train.py", "--config", str(DEFAULT), "--override", *overrides)
    log = tmp_path / "job.log"
    with log.open("w") as out:
        job = subprocess.Popen(
            cmd, cwd=ROOT, env=launch_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_steps(job, save_dir / "metrics.jsonl", 3)
        rank1 = read_heartbeat(save_dir / HEARTBEAT_FILE.format(rank=1))
        assert rank1 is not None and rank1.pid in {p.pid for p in psutil.Process(job.pid).children(recursive=True)}

        os.kill(rank1.pid, signal.SIGSTOP)
        time.sleep(HANG * 0.6)
        os.kill(rank1.pid, signal.SIGCONT)
        done = len((save_dir / "metrics.jsonl").read_text().splitlines())
        wait_for_steps(job, save_dir / "metrics.jsonl", done + 3)

        os.kill(rank1.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        returncode = job.wait(timeout=HANG + 60)
        elapsed = time.monotonic() - stopped
        assert not running_in_group(job.pid, grace=10), "a process of the job is still running"
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(job.pid, sig)
            except ProcessLookupError:
                pass
        job.wait()
    output = log.read_text()
    errors = [line for line in output.splitlines() if "fathom: error:" in line]
    assert returncode != 0 and len(errors) == 1, output[-6000:]
    stalled = re.search(r"rank 0 made no progress for (\d+) s \(training step \d+\): ", errors[0])
    assert stalled and HANG <= int(stalled.group(1)) < HANG + 5, errors[0]
    assert f"rank 1 (host {socket.gethostname()}, pid {rank1.pid}) stopped responding" in errors[0]
    assert errors[0].endswith("; ending the job")
    assert elapsed < HANG + 45
