"""Stopping a run without losing a step: a stop signal asks for a save, and the ranks agree on when.

SIGINT (Ctrl-C), SIGTERM (a scheduler's preemption or time limit, or a launcher passing a stop on),
SIGHUP (the terminal or ssh session went away) and `train.exit_signal` (SIGUSR1 by default: the warning
`sbatch --signal=USR1@120` sends ahead of a time limit) only set a request here; so do
`train.exit_after_minutes` and the end of a launcher (pipeline/safety/launchers.py). A rank cannot act on
it alone: its peers are inside the same collectives. So after every step all ranks all-reduce their
requests (`Stopper.agreed`), and on one they save a checkpoint together, global rank 0 says where the run
stopped and how to go on, and every rank exits with RESUMABLE_EXIT. A save in progress completes first.

Launchers pass a stop on: DeepSpeed's launch.py answers the terminal's SIGINT by sending each rank SIGTERM,
torchrun answers SIGTERM with SIGTERM, and a scheduler may signal the launcher and the ranks alike. So a
signal within ECHO_S of the first is that same stop; a later one, after the request, ends the rank at once
(a save cut short leaves `latest` naming the previous checkpoint). Before training starts there is nothing
to save and a signal ends the rank at once; once the stop's checkpoint is committed, any signal ends it
with RESUMABLE_EXIT, and once the run has failed, a signal ends the rank at once and quietly.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

from fathom.common.run_layout import HEARTBEAT_FILE, has_checkpoints, latest_tag
from fathom.pipeline.checkpoint.run_directory import RunDirectory
from fathom.pipeline.checkpoint.saving import remove_uncommitted
from fathom.pipeline.safety.watchdog import Watchdog

# sysexits.h's EX_TEMPFAIL ("a temporary failure; the user is invited to retry"): stopped with everything
# saved; the same command with --resume goes on. A scheduler's requeue can key on it (Slurm: RequeueExit=75).
RESUMABLE_EXIT = 75
# Always a stop; train.exit_signal adds its own (SIGHUP: the terminal or ssh session went away).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A launcher passing a stop on signals within milliseconds of the stop it passes on; a person's second
# Ctrl-C comes later.
ECHO_S = 3.0
# Why a run stops, beside the signal numbers (1-64): the all-reduce keeps the largest.
TIME_LIMIT = 100
LAUNCHER_ENDED = 101


def reason_text(code: int, exit_after_minutes: float | None = None) -> str:
    if code == TIME_LIMIT:
        return f"train.exit_after_minutes ({exit_after_minutes:g})"
    if code == LAUNCHER_ENDED:
        return "the end of its launcher"
    return signal.Signals(code).name


class Stopper:
    """This rank's answer to stop signals, from its launch to its exit."""

    def __init__(self, rank: int):
        self.rank = rank
        self.requested = 0  # the reason code of this rank's stop request (0: none)
        self.first_signal_at: float | None = None
        self.deadline: float | None = None  # time.monotonic() of train.exit_after_minutes
        self.exit_after_minutes: float | None = None
        self.phase = "starting"  # then "training", then "saved" (or "ending", failed)
        self.run_dir: RunDirectory | None = None
        self.watchdog: Watchdog | None = None
        self.steps_done: Callable[[], int] = lambda: 0
        self.started = time.monotonic()

    def install(self, *signals: signal.Signals) -> Stopper:
        for sig in (*STOP_SIGNALS, *signals):
            signal.signal(sig, self.handle)
        return self

    def training(self, run_dir: RunDirectory, watchdog: Watchdog, steps_done: Callable[[], int],
                 exit_after_minutes: float | None) -> None:  # fmt: skip
        """From now on a stop saves first; `steps_done` reads the steps trained, for the stop's line."""
        self.run_dir, self.watchdog, self.steps_done = run_dir, watchdog, steps_done
        self.exit_after_minutes = exit_after_minutes
        if exit_after_minutes is not None:
            self.deadline = self.started + 60 * exit_after_minutes
        self.phase = "training"

    def request(self, code: int) -> None:
        """Asks for a save and a stop at the next step boundary (the first reason stays)."""
        self.requested = self.requested or code

    def ending(self) -> None:
        """The run failed and says so itself: a signal from now on (the launcher ending the other ranks)
        only hurries the exit."""
        self.phase = "ending"

    def handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.phase == "saved":  # everything is saved: leave now, as a stopped run does
            self.end(RESUMABLE_EXIT)
        if self.phase == "ending":
            self.end(128 + signum)
        if self.phase == "training" and (self.first_signal_at is None or now - self.first_signal_at < ECHO_S):
            self.first_signal_at = self.first_signal_at or now
            self.request(signum)
            return
        for sig in (*STOP_SIGNALS, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        if self.watchdog is not None:
            self.watchdog.stop()  # its thread ends and its heartbeat file goes
        if self.rank == 0:
            again = " again" if self.phase == "training" else ""
            print(f"fathom: stopped by {signal.Signals(signum).name}{again} {self.where()}", file=sys.stderr)
        self.end(128 + signum)

    def end(self, status: int) -> None:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(status)

    def agreed(self, device: torch.device) -> int:
        """Every rank, after each step: the stop the ranks asked for (a reason code), or 0 to go on."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.request(TIME_LIMIT)
        code = torch.tensor([self.requested], dtype=torch.int64, device=device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return int(code.item())

    def saved(self) -> None:
        """The stop's checkpoint is committed on every rank: a signal from now on only hurries the exit."""
        self.phase = "saved"

    def stopped_line(self, code: int, step: int, tag: str) -> str:
        return (f"fathom: stopped by {reason_text(code, self.exit_after_minutes)} after step {step}; the same "
                f"command with --resume continues from {tag}")  # fmt: skip

    def where(self) -> str:
        """Where a run ended at once stopped and how to continue it; cleans what the stop left half-made
        (rank 0). A run that trained a step keeps its directory: its metrics are the record of that work."""
        if self.run_dir is None:
            return "during start-up, before training; nothing was saved"
        save_dir = self.run_dir.path
        remove_uncommitted(save_dir)
        for heartbeat in save_dir.glob(HEARTBEAT_FILE.format(rank="*")):  # peers stopping too, or killed
            heartbeat.unlink(missing_ok=True)
        step = self.steps_done()
        tag = latest_tag(save_dir)
        if tag:
            return f"after step {step}; the same command with --resume continues from {tag}"
        if has_checkpoints(save_dir):  # a `best` from before `latest` named best checkpoints too
            return f"after step {step}; no `latest` to resume from, the checkpoints in {save_dir} are kept"
        removed = self.run_dir.abandon()
        gone = f", so {removed} was removed again" if removed else f"; {save_dir} keeps what the run logged"
        return f"after step {step}; no checkpoint was saved yet{gone}"
