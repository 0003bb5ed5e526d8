"""Files and directories that are whole once written, or never appear: a crash, a full disk or a closed
pipe leaves the old file or a one-line error naming the file, never a partial file that loads as
garbage."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO

import torch

from fathom.common.errors import ConfigError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unique_sibling(path: Path) -> Path:
    """A hidden name beside `path` that no other writer picks: two processes writing one output at once
    each rename their own complete file into place, instead of one renaming the other's away."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def write_atomic(path: Path, text: str | bytes) -> None:
    """Readers see the old content or the new, never a partial file, whenever the writer dies. A link's
    target is replaced, not the link; a device or pipe (--output /dev/stdout) is written in place."""
    try:
        mode = "wb" if isinstance(text, bytes) else "w"
        if path.exists() and not path.is_file():
            with open(path, mode) as f:
                f.write(text)
            return
        path = Path(os.path.realpath(path))
        tmp = unique_sibling(path)
        try:
            with open(tmp, mode.replace("w", "x")) as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:  # a full disk leaves no temporary file behind
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
    except OSError as err:  # a failed write or close names no file
        raise OSError(err.errno, err.strerror, str(path)) from None


class ErrorKeepingWriter:
    """A file for torch.save that keeps the OSError of a failed write: torch's zip writer reports a full
    disk as a RuntimeError about a file position, without the system's reason or the file's name."""

    def __init__(self, file: BinaryIO, path: str | Path) -> None:
        self.file, self.path = file, str(path)
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = OSError(err.errno, err.strerror, self.path)
            raise

    def flush(self) -> None:
        self.file.flush()


def save_file(obj: Any, path: str | Path, zipfile_serialization: bool = True) -> None:
    """torch.save, then fsync: on disk once this returns. A write that fails (a full disk) raises the
    system's OSError naming the file."""
    with open(path, "wb") as f:
        writer = ErrorKeepingWriter(f, path)
        try:
            torch.save(obj, writer, _use_new_zipfile_serialization=zipfile_serialization)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None
        os.fsync(f.fileno())


def try_lock(path: Path, shared: bool = False) -> IO[str] | None:
    """The open lock file, locked exclusively (`shared`: shared, which only an exclusive holder refuses), or
    None when another process holds it so (the kernel releases it however the holder ends)."""
    handle = open(path, "a+")  # noqa: SIM115 (kept open: closing it releases the lock)
    try:
        fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    except OSError as err:  # a filesystem without locks (some NFS mounts): go unguarded rather than not at all
        print(f"fathom: warning: {path}: cannot lock ({err.strerror}); no other process is kept out", file=sys.stderr)
    return handle


def lock_holder(path: Path) -> str:
    """What the process holding the lock file wrote into it (e.g. `pid 123 on host`)."""
    return path.read_text().strip() or "another process"


@contextmanager
def writing_lock(out: Path) -> Iterator[None]:
    """Holds `.OUT.lock` beside `out` while a command writes it: a second command writing the same output
    at the same time is refused in one line. Checking that `out` does not exist yet is not enough: both
    check before either has written it."""
    lock = out.with_name(f".{out.name}.lock")
    handle = try_lock(lock)
    if handle is None:
        raise ConfigError(f"{out}: another command is writing it now ({lock_holder(lock)}); wait for it to end, "
                          "or choose another output")  # fmt: skip
    try:
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
    finally:
        lock.unlink(missing_ok=True)
        handle.close()


@contextmanager
def staged(out: Path, replace: bool = False) -> Iterator[Path]:
    """A fresh directory beside `out`, renamed to `out` only when the block completes: an error never
    leaves a half-written `out`, and the staging directory is always removed. No other command writes
    `out` meanwhile (writing_lock); an `out` there at the end is replaced only with `replace` (--force)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with writing_lock(out):
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        staging.chmod(0o755)  # mkdtemp makes it private
        try:
            yield staging
            taken = out.exists() and not (out.is_dir() and not any(out.iterdir()))  # an empty folder is free
            if taken and not replace:
                raise ConfigError(f"{out}: appeared while this command ran; pass --force to replace it")
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
