"""Ctrl-C (SIGINT), SIGTERM (a cluster's scheduler, or DeepSpeed's launcher passing a Ctrl-C on) or SIGHUP:
every rank ends at once, no traceback, no heartbeat or half-saved checkpoint left behind, and global
rank 0 says where the run stopped and how to go on.

The launcher answers SIGINT by sending every rank SIGTERM, whose default action kills a process
outright, so both signals get this handler; so does SIGHUP, which a closed terminal sends. Python runs
it between bytecodes: a rank waiting inside a collective gets there once its peer, gone, breaks the
connection.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

from fathom.common.run_layout import HEARTBEAT_FILE, has_checkpoints, latest_tag
from fathom.pipeline.checkpoint.run_directory import RunDirectory
from fathom.pipeline.checkpoint.saving import remove_uncommitted
from fathom.pipeline.safety.watchdog import Watchdog

# SIGHUP: the terminal or ssh session the job was started from went away.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_on_signals(rank: int, save_dir: RunDirectory | None = None, watchdog: Watchdog | None = None,
                    steps_done: Callable[[], int] | None = None) -> None:  # fmt: skip
    """From now on SIGINT, SIGTERM and SIGHUP end this process with status 128 + signal. Before the run has a
    save_dir (start-up), nothing needs cleaning; after, pass the run's save_dir, watchdog and step count."""

    def stop(signum: int, frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:  # the launcher's SIGTERM follows a Ctrl-C's SIGINT: stop once
            signal.signal(sig, signal.SIG_IGN)
        if watchdog is not None:
            watchdog.stop()  # its thread ends and its heartbeat file goes
        if rank == 0:
            print(f"fathom: stopped by {signal.Signals(signum).name} {where(save_dir, steps_done)}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def where(save_dir: RunDirectory | None, steps_done: Callable[[], int] | None) -> str:
    """Where the run stopped and how to continue it; cleans what the stop left half-made (rank 0)."""
    if save_dir is None or steps_done is None:
        return "during start-up, before training; nothing was saved"
    remove_uncommitted(save_dir.path)
    for heartbeat in save_dir.path.glob(HEARTBEAT_FILE.format(rank="*")):  # peers stopping too, or killed
        heartbeat.unlink(missing_ok=True)
    tag = latest_tag(save_dir.path)
    if tag:
        return f"after step {steps_done()}; the same command with --resume continues from {tag}"
    if has_checkpoints(save_dir.path):  # a `best` from before `latest` named best checkpoints too
        return f"after step {steps_done()}; no `latest` to resume from, the checkpoints in {save_dir.path} are kept"
    removed = save_dir.abandon()
    gone = f", so {removed} was removed again" if removed else ""
    return f"after step {steps_done()}; no checkpoint was saved yet{gone}"
