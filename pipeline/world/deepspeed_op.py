"""DeepSpeed's shared-memory all-reduce for CPU ranks, compiled once per Python environment, and a build that
died named in one line instead of waited on forever.

DeepSpeed 0.19.8 compiles this op (deepspeed_shm_comm) the first time a process needs it, inside
deepspeed.init_distributed: comm/torch.py's build_shm_op, called by TorchBackend's constructor before the process
group exists, calls the CPU accelerator's ShareMemCommBuilder().load(), which hands it to torch's
cpp_extension.load. torch builds it in $TORCH_EXTENSIONS_DIR/deepspeed_shm_comm, by default
~/.cache/torch_extensions/py311_cpu/ for every environment of that Python version: environments with another
torch (other include paths) or another ninja rebuild it in turn, about a minute each. The process that builds
holds `lock` in that directory (torch's FileBaton) and every other one polls for the file to go, forever and
without a word; a rank killed mid-build (SIGKILL skips the release) left every later start hanging.

`prepare_cpu_op`, on each CPU rank before deepspeed.init_distributed, loads the op as DeepSpeed would (DeepSpeed
then finds it loaded), in a directory of this environment's own and with this environment's ninja, and waits on
another process's build with `wait_for_build`, which ends in a ConfigError once the lock's holder is gone.
`python -m fathom.pipeline.world.deepspeed_op` builds it ahead (`make install`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from fathom.common.errors import ConfigError, exit_on_config_error

VARIABLE = "TORCH_EXTENSIONS_DIR"  # where torch's cpp_extension builds; read at each build, not at import
# The directories this module derives, told apart from one a user chose: a value inherited from a process of
# another environment is replaced, not shared.
DERIVED_NAME = re.compile(r"fathom-[0-9a-f]{12}")
# A build writes nothing in its directory while the compiler runs (its objects appear at the end, about 35 s on
# 2 idle cores, minutes on a loaded machine), so a stale lock is only told from a slow build by time. A build
# running on this machine never counts towards it (local_builders); this bounds how long a build on another
# machine sharing the directory may look idle, and how long a dead lock holds a start.
DEFAULT_TIMEOUT = 120.0
POLL_S = 1.0


def environment_extensions_dir(prefix: str = sys.prefix) -> Path:
    """This environment's own build root, beside torch's default one (~/.cache/torch_extensions): in the user's
    cache rather than inside the environment, which may be read-only or shared by several users. Derived from
    what the op is built against, not from the process's environment variables, so a rank started over ssh
    finds the same directory as one started here."""
    key = [os.path.realpath(prefix), sys.version, platform.machine(), torch.__version__]
    key += [str(torch.version.git_version), deepspeed.__version__]
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:12]
    return Path(cpp_extension.get_default_build_root()) / f"fathom-{digest}"


def use_environment_extensions_dir(environ: MutableMapping[str, str] = os.environ, prefix: str = sys.prefix) -> Path:
    """TORCH_EXTENSIONS_DIR as the user set it, or else this environment's own directory (set in `environ`,
    where torch's build reads it). An empty value is taken as unset: torch would build under the working
    directory."""
    current = environ.get(VARIABLE, "")
    if current and not DERIVED_NAME.fullmatch(Path(current).name):
        return Path(current)
    root = environment_extensions_dir(prefix)
    environ[VARIABLE] = str(root)
    return root


def local_builders(lock: Path) -> list[int]:
    """Processes on this machine building in lock's directory: a ninja running there (torch builds through
    ninja, which goes on compiling after the process that started it was killed; a shell that only sits
    there does not count), or the builder, which keeps the lock open until it releases it. Processes of
    other machines sharing the directory, or of other containers, are not seen."""
    directory, lock_path, pids = str(lock.parent.resolve()), str(lock.resolve()), []
    for proc in os.scandir("/proc"):
        if proc.name.isdigit():
            try:
                if os.readlink(f"{proc.path}/cwd") == directory and Path(proc.path, "comm").read_text() == "ninja\n":
                    pids.append(int(proc.name))
            except OSError:  # gone, or another user's
                pass
    if pids:
        return pids
    for proc in os.scandir("/proc"):  # only between the build's steps, or when none runs: every open file
        if proc.name.isdigit():
            try:
                if any(os.readlink(fd.path) == lock_path for fd in os.scandir(f"{proc.path}/fd")):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def last_change(directory: Path) -> float:
    """When anything in the build directory (the lock, build.ninja, objects, the library) last changed."""
    newest = directory.stat().st_mtime
    for entry in os.scandir(directory):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except FileNotFoundError:
            pass
    return newest


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def waiting_for(builders: list[int], directory: Path, quiet: float) -> str:
    if not builders:
        return (
            f"waiting for the build of DeepSpeed's CPU op in {directory}: no process on this machine builds it, "
            f"but its files changed {duration(quiet)} ago (another machine sharing the directory?)"
        )
    try:
        name = Path(f"/proc/{builders[0]}/comm").read_text().strip()
    except OSError:  # it just ended
        name = "ended"
    return f"waiting for process {builders[0]} ({name}) building DeepSpeed's CPU op in {directory}"


def wait_for_build(lock: Path, timeout: float, poll: float = POLL_S) -> None:
    """Returns once `lock` is gone, as torch's FileBaton.wait does. Where no process on this machine builds and
    nothing in the build directory changed for `timeout` seconds (by the files' times, so a lock left long ago
    fails at once), the lock's holder died mid-build: a ConfigError naming it. A live build is waited for,
    with a line every `timeout` seconds saying on what."""
    noted, seen = time.time(), 0.0
    while True:
        try:
            held_since, changed = lock.stat().st_mtime, last_change(lock.parent)
        except FileNotFoundError:  # released (or the directory removed): torch goes on to load
            return
        builders = local_builders(lock)
        now = time.time()
        if builders:
            seen = now
        # a time ahead of this clock (another machine's) counts as a change now
        quiet, held = now - max(seen, min(changed, now)), duration(max(0.0, now - held_since))
        if quiet >= timeout:
            raise ConfigError(
                f"{lock}: held for {held} by no process on this machine, its build directory unchanged for "
                f"{duration(quiet)}: a build of DeepSpeed's CPU op was killed midway; remove the lock if no build "
                "is running (on any machine sharing the directory) and start again"
            )
        if now - noted >= timeout:
            print(f"fathom: {waiting_for(builders, lock.parent, quiet)}; its lock held for {held}", flush=True)
            noted = now
        time.sleep(poll)


class WatchedBaton(FileBaton):
    """torch's build lock, with wait_for_build for its silent wait, that says when it compiles from scratch."""

    def __init__(self, lock_file_path: str, timeout: float) -> None:
        super().__init__(lock_file_path)
        self.timeout = timeout

    def try_acquire(self) -> bool:
        acquired = bool(super().try_acquire())
        directory = Path(self.lock_file_path).parent
        if acquired and not any(directory.glob("*.so")):  # else ninja finds it built, in well under a second
            print(f"fathom: compiling DeepSpeed's CPU op for this Python environment, once (about a minute), in "
                  f"{directory}", flush=True)  # fmt: skip
        return acquired

    def wait(self) -> None:
        wait_for_build(Path(self.lock_file_path), self.timeout)


@contextmanager
def watched_builds(timeout: float) -> Iterator[None]:
    """torch's _jit_compile takes the lock as FileBaton(build_directory/lock), a name it looks up in its module
    at each build (tests/test_deepspeed_op.py checks): this process's builds meanwhile wait with a timeout."""
    saved = cpp_extension.FileBaton
    cpp_extension.FileBaton = partial(WatchedBaton, timeout=timeout)
    try:
        yield
    finally:
        cpp_extension.FileBaton = saved


def environment_ninja() -> str:
    """The ninja binary of the `ninja` distribution this Python imports (a DeepSpeed requirement), "" if none. By
    its installed files, not PATH or the scripts directory: a venv with system site packages uses its base's."""
    try:
        distribution = importlib.metadata.distribution("ninja")
    except importlib.metadata.PackageNotFoundError:
        return ""
    for file in distribution.files or ():
        if file.name == "ninja":
            path = os.path.realpath(distribution.locate_file(file))
            if os.access(path, os.X_OK):
                return path
    return ""


@contextmanager
def ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH. A rank started over ssh has sshd's PATH, and so the system's ninja, which
    reads the build log the environment's writes as commands changed (1.11 against 1.13): each rebuilt what the
    other built. During the build this environment's ninja comes first, as in an activated environment."""
    ninja, path = environment_ninja(), os.environ.get("PATH", "")
    if not ninja or os.path.realpath(shutil.which("ninja") or "") == os.path.realpath(ninja):
        yield
        return
    os.environ["PATH"] = os.path.dirname(ninja) + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def prepare_cpu_op(timeout: float = DEFAULT_TIMEOUT) -> Path | None:
    """Builds or loads DeepSpeed's CPU all-reduce op in this environment's build directory, as DeepSpeed's
    init_distributed would, which then finds it loaded; returns that directory, or None where DeepSpeed uses no
    such op (another accelerator, or one it finds incompatible). A build that another process holds is waited
    for, and one whose holder died raises ConfigError after `timeout` seconds without progress."""
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    # comm/torch.py's build_shm_op: DeepSpeed builds the op only where its probe finds it compatible
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    root = use_environment_extensions_dir()
    with watched_builds(timeout), ninja_on_path():
        builder.load()
    return root / builder.NAME


def main() -> None:
    with exit_on_config_error():
        directory = prepare_cpu_op()
    if directory is not None:
        print(f"fathom: DeepSpeed's CPU op is built in {directory}", flush=True)


if __name__ == "__main__":  # python -m fathom.pipeline.world.deepspeed_op: `make install` builds it ahead
    main()
