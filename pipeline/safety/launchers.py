"""A rank stops, saving first, when a launcher that started it ends.

`kill PID` of `deepspeed` (or fathom-launch) ends the runner alone: DeepSpeed's launch.py and the ranks
under it went on training with no launcher a user or scheduler could reach. Under pdsh a rank's launcher
runs in an ssh session; when that connection goes (pdsh or its ssh ended), nothing signals the remote
processes. So each rank watches the chain of processes that launched it, from its parent up: DeepSpeed's
launch.py and runner, torchrun, fathom-launch (which names itself in FATHOM_LAUNCHER_PID), and a remote
command's ssh session; the first process that is none of these (a shell, slurmstepd, mpirun, init) ends the
chain, so a job started with nohup outlives the terminal it was started from. When one of them ends, the
rank asks its Stopper for a stop (LAUNCHER_ENDED); a session's end also takes the rank's output with it,
so from then on the rank writes it to /dev/null rather than fail on a closed pipe.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

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
        if not arg.startswith("-"):
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


def watch_launchers(on_end: Callable[[str], None]) -> threading.Thread | None:
    """Starts a daemon thread that calls on_end(what ended) once, when a process of this rank's launcher
    chain ends; None when nothing launched it that fathom watches."""
    chain = launcher_chain()
    if not chain:
        return None
    # read while they run: a process that has ended has no command line left to read
    watched = [(process, describe(process), is_ssh_session(process)) for process in chain]

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(POLL_S):
            for process, name, session in watched:
                if ended(process):
                    if session:
                        silence_output()
                    on_end(name)
                    return

    thread = threading.Thread(target=watch, name="fathom-launcher-watch", daemon=True)
    thread.start()
    return thread


def silence_output() -> None:
    """Points stdout and stderr at /dev/null: the ssh connection that carried them is gone, and a write to
    its closed pipe would raise in whatever code prints next."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
