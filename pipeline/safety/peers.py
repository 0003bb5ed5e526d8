"""A peer rank that died mid-job: one line on each survivor instead of a 30-line traceback from the backend.

When a rank dies (killed, out of memory, its node gone), its peers' next collective or pipeline send
fails inside gloo or nccl with "Connection closed by peer" and a traceback through DeepSpeed's engine.
The survivors cannot save (the job is one model), so each says which peer is gone (from the hang
watchdog's heartbeats: a rank whose file is gone or whose process on this host is dead), what the
backend said, and the checkpoint --resume continues from, and exits with status 1.

A killed process's sockets close before it has finished dying, so the survivor can see the lost connection
while the peer still reads as running; it looks again for up to DYING_GRACE seconds before settling for
"a peer rank".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from fathom.common.run_layout import HEARTBEAT_FILE, latest_tag
from fathom.pipeline.safety.launchers import ended
from fathom.pipeline.safety.watchdog import read_heartbeat

# What gloo and nccl say when a peer's connection ends.
LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")
DYING_GRACE = 10.0  # seconds; freeing a large process's memory as it exits can take seconds


def lost_peer(err: BaseException) -> str | None:
    """The backend's own words for a lost connection in `err` (its first line), else None."""
    text = str(err)
    if not any(words in text for words in LOST):
        return None
    first = text.strip().splitlines()[0]
    return first.split("] ", 1)[-1].split(". This is typically")[0]  # gloo's file:line prefix and its advice


def alive(pid: int) -> bool:
    try:
        return not ended(psutil.Process(pid))
    except psutil.Error:  # no such process
        return False


def gone_peers(save_dir: Path, rank: int, world_size: int, host: str) -> list[str]:
    """Peers whose heartbeat file is gone (a rank removes it as it ends) or whose process on this host is dead."""
    gone = []
    for peer in range(world_size):
        if peer == rank:
            continue
        heartbeat = read_heartbeat(save_dir / HEARTBEAT_FILE.format(rank=peer))
        if heartbeat is None:
            gone.append(f"rank {peer}")
        elif heartbeat.host == host and not alive(heartbeat.pid):
            gone.append(f"rank {peer} (pid {heartbeat.pid})")
    return gone


def gone_peers_within(save_dir: Path, rank: int, world_size: int, host: str, grace: float = DYING_GRACE) -> list[str]:
    """gone_peers, looking again until one is found or `grace` seconds pass: a peer may still be dying."""
    deadline = time.monotonic() + grace
    while not (gone := gone_peers(save_dir, rank, world_size, host)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return gone


@contextmanager
def exit_on_lost_peer(save_dir: Path, rank: int, world_size: int, host: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as err:
        said = lost_peer(err)
        if said is None:
            raise
        gone = gone_peers_within(save_dir, rank, world_size, host)
        who = " and ".join(gone) if gone else "a peer rank"
        tag = latest_tag(save_dir) if save_dir.is_dir() else None
        resume = f"the same command with --resume continues from {tag}" if tag else "no checkpoint was saved yet"
        print(f"fathom: error: rank {rank}: lost {who}, so the job ends ({said}); {resume}", file=sys.stderr,
              flush=True)  # fmt: skip
        sys.exit(1)
