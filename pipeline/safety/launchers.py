"""A rank stops, saving first, when a launcher that started it ends.

`kill PID` of `deepspeed` (or fathom-launch) ends the runner alone: DeepSpeed's launch.py and the ranks
under it went on training with no launcher a user or scheduler could reach. Under pdsh a rank's launcher
runs in an ssh session; when that connection goes (pdsh or its ssh ended), nothing signals the remote
processes. So each rank watches the chain of processes that launched it, from its parent up: DeepSpeed's
launch.py and runner, torchrun, fathom-launch (which names itself in FATHOM_LAUNCHER_PID), and a remote
command's ssh session; the first process that is none of these (a shell, slurmstepd, mpirun, init) ends the
chain, so a job started with nohup outlives the terminal it was started from. A killed pdsh ends none of
them (its ssh clients live on) but stops reading what the ranks print: so a rank whose stdout or stderr is
a pipe nobody reads any more counts its launcher as gone too, and writes to /dev/null from then on rather
than fail on the closed pipe. Either way the rank asks its Stopper for a stop (LAUNCHER_ENDED).
"""

from __future__ import annotations

import os
import select
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import psutil

# The environment variable fathom-launch sets for the ranks it starts: its own pid.
LAUNCHER_PID = "FATHOM_LAUNCHER_PID"
LAUNCHER_MODULES = {"deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                    "torch.distributed.launch", "fathom.pipeline.launch.command"}  # fmt: skip
LAUNCHER_SCRIPTS = {"deepspeed", "ds", "torchrun", "fathom-launch"}
SHELLS = {"sh", "bash", "dash", "zsh"}
POLL_S = 0.5


def python_program(args: list[str]) -> str | None:
    """The module (`-m NAME`) or script name a Python command line runs; None for another program."""
    if not args or not Path(args[0]).name.startswith("python"):
        return None
    rest = iter(args[1:])
    for arg in rest:
        if arg == "-m":
            return next(rest, None)
        if arg in ("-c", "-"):
            return None
        if arg in ("-X", "-W"):  # options that take the next argument
            next(rest, None)
        elif not arg.startswith("-"):
            return Path(arg).name
    return None


def is_launcher(process: psutil.Process, environ: dict[str, str]) -> bool:
    if environ.get(LAUNCHER_PID) == str(process.pid):
        return True
    args = process.cmdline()
    program = python_program(args)
    name = Path(args[0]).name if args else ""
    return program in LAUNCHER_MODULES or program in LAUNCHER_SCRIPTS or name in LAUNCHER_SCRIPTS


def is_ssh_session(process: psutil.Process) -> bool:
    """sshd's process for one connection (`sshd: USER@notty`), whose end is the connection's."""
    args = process.cmdline()
    return bool(args) and args[0].startswith("sshd:")


def launcher_chain(
    process: psutil.Process | None = None, environ: dict[str, str] | None = None
) -> list[psutil.Process]:
    """The launchers above `process` (this one), nearest first, and the ssh session a remote launch runs in."""
    environ = dict(os.environ) if environ is None else environ
    chain = []
    for ancestor in (process or psutil.Process()).parents():
        try:
            if is_ssh_session(ancestor):
                chain.append(ancestor)
                break
            if is_launcher(ancestor, environ):
                chain.append(ancestor)
                continue
            # `ssh HOST 'cd DIR; python -m deepspeed.launcher.launch ...'` runs the launcher under a shell
            if chain and Path(ancestor.name()).name in SHELLS and "-c" in ancestor.cmdline():
                continue
        except psutil.Error:  # gone already, or not ours to read
            pass
        break
    return chain


def ended(process: psutil.Process) -> bool:
    try:  # a killed launcher stays a zombie until its parent reaps it
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def describe(process: psutil.Process) -> str:
    args = process.cmdline()
    return f"{python_program(args) or (args[0] if args else 'a launcher')} (pid {process.pid})"


def piped_outputs() -> list[int]:
    """This rank's stdout and stderr where they are pipes or sockets: a reader that can go away."""
    return [fd for fd in (1, 2) if stat.S_ISFIFO(os.fstat(fd).st_mode) or stat.S_ISSOCK(os.fstat(fd).st_mode)]


def output_closed(fds: list[int]) -> bool:
    """Whether nobody reads these any more: poll reports an error or hangup on a pipe or socket whose reading
    end closed (pdsh killed: its ssh clients stop passing output on, and sshd closes the pipes)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLOUT)
    return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))


class GuardedStream:
    """sys.stdout or sys.stderr, whose write to a pipe nobody reads any more (pdsh killed: sshd closes the
    pipes a moment later) calls `on_closed` and points the stream at /dev/null instead of raising
    BrokenPipeError in whatever code printed."""

    def __init__(self, stream: TextIO, on_closed: Callable[[], None]):
        self._stream, self._on_closed = stream, on_closed

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._on_closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._on_closed()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def watch_launchers(on_end: Callable[[str], None]) -> threading.Thread | None:
    """Starts a daemon thread that calls on_end(what ended) once, when a process of this rank's launcher
    chain ends or nobody reads its output any more (from then on it goes to /dev/null, as a write to a
    closed pipe would raise in whatever code prints next); None when there is nothing to watch."""
    chain, outputs = launcher_chain(), piped_outputs()
    if not chain and not outputs:
        return None
    ended_once = threading.Lock()

    def closed() -> None:
        silence_output()
        if ended_once.acquire(blocking=False):
            on_end("the reader of its output")

    if outputs:
        sys.stdout, sys.stderr = GuardedStream(sys.stdout, closed), GuardedStream(sys.stderr, closed)
    # read while they run: a process that has ended has no command line left to read
    watched = [(process, describe(process), is_ssh_session(process)) for process in chain]

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(POLL_S):
            if outputs and output_closed(outputs):
                return closed()
            for process, name, session in watched:
                if ended(process):
                    if session:  # the connection that carried the output is gone with it
                        silence_output()
                    if ended_once.acquire(blocking=False):
                        on_end(name)
                    return

    thread = threading.Thread(target=watch, name="fathom-launcher-watch", daemon=True)
    thread.start()
    return thread


def silence_output() -> None:
    """Points stdout and stderr at /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
