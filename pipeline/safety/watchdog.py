"""Ends a job that stopped making progress, naming the rank to blame, instead of hanging in the backend.

Between `start()` and `stop()` each rank runs a thread that rewrites a heartbeat file,
SAVE_DIR/heartbeat-rank{R}.json, every few seconds: a counter only a live process keeps changing,
with the rank's host, pid and what its training loop is doing. The loop marks progress whenever it
starts a step, a validation pass or a checkpoint save. Once this rank has made no progress for half of
`train.hang_timeout`, its thread also reads its peers' heartbeats, and at `train.hang_timeout` it blames

1. the peers whose heartbeat did not change while it watched (stopped, dead, or cut off), else
2. the ranks with the fewest progress marks (alive, but stuck in their own work; every rank makes
   the same marks in the same order), else
3. nobody in particular: all ranks are alive at the same point, waiting on each other,

prints one line and ends its process: the main thread is blocked inside the backend, so only
os._exit gets out. The launcher then ends the other ranks. Heartbeats are compared over time on the
watching rank's own clock, never across hosts' clocks, and peers are read only while a rank is
stalled, so a healthy job of N ranks costs N small writes every few seconds and no reads.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from fathom.common.run_layout import HEARTBEAT_FILE

# The backend (gloo, nccl) gives up this long after hang_timeout, so the watchdog, which decides within
# one check interval of it, names the rank first; the backend's own error names none.
BACKEND_GRACE_S = 30.0


def check_interval(hang_timeout: float) -> float:
    """Seconds between heartbeats and checks: a tenth of the timeout, so a live rank writes several while
    a stalled one watches; at most 10 s, so the decision lands well inside BACKEND_GRACE_S after the timeout."""
    return min(hang_timeout / 10, 10.0)


def backend_timeout(hang_timeout: float) -> timedelta:
    return timedelta(seconds=hang_timeout + BACKEND_GRACE_S)


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    host: str
    pid: int
    beat: int  # +1 per write: the content keeps changing as long as the process runs
    progress: int  # progress marks so far
    doing: str  # since the last mark, e.g. "training step 13"


@dataclass(frozen=True)
class Seen:
    """A peer's heartbeat as last read (None: no readable file) and when the watcher first read it."""

    heartbeat: Heartbeat | None
    since: float


def watch(seen: dict[int, Seen], readings: dict[int, Heartbeat | None], now: float) -> None:
    """Updates what was seen of each peer with one round of readings taken at `now`."""
    for rank, heartbeat in readings.items():
        if rank not in seen or seen[rank].heartbeat != heartbeat:
            seen[rank] = Seen(heartbeat, now)


def describe(rank: int, heartbeat: Heartbeat | None, save_dir: Path) -> str:
    if heartbeat is None:
        return f"rank {rank} (no heartbeat file in {save_dir}; train.save_dir must be on a filesystem all nodes share)"
    return f"rank {rank} (host {heartbeat.host}, pid {heartbeat.pid})"


def blame(me: Heartbeat, seen: dict[int, Seen], now: float, stopped_after: float, save_dir: Path) -> str:
    """Who keeps the job from progressing, as a phrase; `seen` holds every peer of rank `me.rank`, watched
    for longer than `stopped_after` seconds, the time after which an unchanged heartbeat means stopped."""
    stopped = {rank: s for rank, s in sorted(seen.items()) if s.heartbeat is None or now - s.since >= stopped_after}
    if stopped:
        names = " and ".join(describe(rank, s.heartbeat, save_dir) for rank, s in stopped.items())
        unchanged = [now - s.since for s in stopped.values() if s.heartbeat is not None]
        detail = f" (heartbeat unchanged for {min(unchanged):.0f} s)" if unchanged else ""
        return f"{names} stopped responding{detail}"
    alive = [me, *(s.heartbeat for s in seen.values())]
    fewest = min(h.progress for h in alive)
    behind = sorted((h for h in alive if h.progress == fewest), key=lambda h: h.rank)
    if len(behind) == len(alive) > 1:
        return f"all {len(alive)} ranks are alive and in {me.doing}, none behind: they wait on each other"
    names = " and ".join(describe(h.rank, h, save_dir) for h in behind)
    verb = "is" if len(behind) == 1 else "are"
    further = " while other ranks went further" if len(behind) < len(alive) else ""
    return f"{names} {verb} alive but stuck in {behind[0].doing}{further}"


def read_heartbeat(path: Path) -> Heartbeat | None:
    try:
        return Heartbeat(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # not written yet, or not ours
        return None


class Watchdog:
    """This rank's heartbeat and hang check, run by a daemon thread between start() and stop()."""

    def __init__(self, save_dir: Path, rank: int, world_size: int, hang_timeout: float):
        self.save_dir, self.rank, self.world_size, self.hang_timeout = save_dir, rank, world_size, hang_timeout
        self.interval = check_interval(hang_timeout)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.beat = 0
        self.clock = time.monotonic  # a test's own clock decides without waiting
        # (progress marks, doing, when), replaced whole so the thread never reads half an update
        self.mark = (0, "start-up", self.clock())
        self.seen: dict[int, Seen] = {}  # the peers' heartbeats while this rank is stalled
        self.watching_since: float | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="fathom-watchdog", daemon=True)

    def path(self, rank: int) -> Path:
        return self.save_dir / HEARTBEAT_FILE.format(rank=rank)

    def start(self) -> Watchdog:
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.publish()
        self.thread.start()
        return self

    def progress(self, doing: str) -> None:
        """Marks progress: this rank finished what it was doing and now does `doing`."""
        self.mark = (self.mark[0] + 1, doing, self.clock())

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.path(self.rank).unlink(missing_ok=True)

    def heartbeat(self) -> Heartbeat:
        progress, doing, _ = self.mark
        return Heartbeat(self.rank, self.host, self.pid, self.beat, progress, doing)

    def publish(self) -> None:
        self.beat += 1
        path = self.path(self.rank)
        temporary = path.with_name(f".{path.name}.tmp")
        try:
            temporary.write_text(json.dumps(asdict(self.heartbeat())))
            os.replace(temporary, path)  # readers see the old heartbeat or the new one, never half of one
        except OSError:
            # A missing heartbeat only matters once the job hangs, when it makes this rank look stopped;
            # a full or flaky filesystem must not end a healthy run.
            pass

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.publish()
            self.check(self.clock())

    def check(self, now: float) -> None:
        """One check: after half of hang_timeout without progress this rank watches its peers'
        heartbeats; after watching them for another half it ends the job, naming the rank to blame."""
        window = self.hang_timeout / 2
        stalled = now - self.mark[2]
        if stalled < window:
            self.seen.clear()
            self.watching_since = None
            return
        self.watching_since = now if self.watching_since is None else self.watching_since
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        watch(self.seen, {rank: read_heartbeat(self.path(rank)) for rank in peers}, now)
        # Decide only after watching for a whole window, even if this thread itself was held up
        # past hang_timeout: an unchanged heartbeat means nothing over a shorter time.
        if now - self.watching_since >= window:
            self.end_job(stalled, blame(self.heartbeat(), self.seen, now, window / 2, self.save_dir))

    def end_job(self, stalled: float, culprit: str) -> None:
        print(
            f"fathom: error: rank {self.rank} made no progress for {stalled:.0f} s ({self.mark[1]}): "
            f"{culprit}; ending the job",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
