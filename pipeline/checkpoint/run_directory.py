"""train.save_dir while a run uses it: one run at a time, and nothing half-made left by one that fails.

Two runs writing one directory would interleave their checkpoints, metrics and `latest` without an
error, so global rank 0 holds an exclusive flock on SAVE_DIR/.fathom.lock for the whole run; the kernel
releases it however the process ends, so a killed run leaves no stale lock. A run that ends with an
error or a signal before its first step leaves nothing worth keeping: its records go, and so does each
directory it made that is then empty (a run that logged a step keeps its metrics). One holding anything
else stays, with its parents: another run may have made its own directory beside this one's, under a
parent this run made, since. A run stopped by a non-finite loss keeps its directory (its logs show the
divergence).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import IO

from fathom.common.errors import ConfigError
from fathom.common.files import lock_holder, try_lock
from fathom.common.run_layout import LOCK_FILE, METRICS_FILE, has_checkpoints, reserved_name


def _in_use(save_dir: Path) -> ConfigError:
    holder = lock_holder(save_dir / LOCK_FILE)
    return ConfigError(
        f"train.save_dir: {save_dir} is in use by a running job ({holder}); wait for it to end or choose another"
    )


def check_not_in_use(save_dir: Path) -> None:
    """Before launch: refuses a save_dir another run is training in. Every rank of a launch asks at once, so
    the question is a shared lock: an exclusive one made two ranks' questions refuse each other."""
    if not (save_dir / LOCK_FILE).is_file():
        return
    handle = try_lock(save_dir / LOCK_FILE, shared=True)
    if handle is None:
        raise _in_use(save_dir)
    handle.close()


def logged_steps(save_dir: Path) -> bool:
    """Whether a run in save_dir has trained and logged a step: the record of work no stop may delete."""
    metrics = save_dir / METRICS_FILE
    return metrics.is_file() and metrics.stat().st_size > 0


class RunDirectory:
    """SAVE_DIR as global rank 0 holds it during a run (other ranks only read `path`)."""

    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank
        # The directories this run made (or found empty), deepest first: what it may remove again.
        self.made: list[Path] = []
        self._lock: IO[str] | None = None

    def open(self) -> None:
        """Makes and locks the directory (rank 0); raises ConfigError if another run holds it."""
        if self.rank != 0:
            return
        absolute = self.path.absolute()
        missing = [p for p in (absolute, *absolute.parents) if not p.exists()]
        self.made = missing or ([] if any(absolute.iterdir()) else [absolute])
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = try_lock(self.path / LOCK_FILE)
        if self._lock is None:  # another run took it between our check and now
            self.made = []
            raise _in_use(self.path)
        self._lock.truncate(0)
        self._lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._lock.flush()

    def close(self) -> None:
        """Releases the lock: the run is over (a process may train again, as the tests' workers do)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def abandon(self) -> Path | None:
        """After an error or a stop, in a directory this run made and saved no checkpoint into (a `best`
        is one, whatever `latest` says): removes the run's records, then each directory it made, deepest
        first, while it is empty. Returns the topmost directory removed, None if none was."""
        if not self.made or not self.path.is_dir() or has_checkpoints(self.path) or logged_steps(self.path):
            return None
        for entry in self.path.iterdir():
            if reserved_name(entry.name):  # written by this run: the lock keeps any other run out
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        removed = None
        for directory in self.made:
            try:
                directory.rmdir()  # refused for a directory that is not empty: never another's files
            except OSError:
                break
            removed = directory
        return removed
