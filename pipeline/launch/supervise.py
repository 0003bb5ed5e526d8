"""fathom-launch runs DeepSpeed's runner (what `deepspeed` runs) as its child and passes a stop on to the
ranks, so that a stop saves and the command returns only once the ranks have.

DeepSpeed's launchers end a job without waiting: `deepspeed` dies on a SIGTERM of its own and leaves
launch.py and the ranks training; launch.py answers a signal by terminating its ranks one after another
(SIGKILL 30 s after each one's SIGTERM); under pdsh the runner kills pdsh, so the ranks' last lines never
reach the terminal. Here the runner starts in a session of its own, where neither the terminal's Ctrl-C
nor its hangup reaches it, and the first SIGINT, SIGTERM, SIGHUP, SIGUSR1 or SIGUSR2 fathom-launch gets
goes to the ranks themselves (pipeline/safety/signals.py: they save and exit with 75): on this machine to
the children of DeepSpeed's launch.py, under pdsh by a `pkill` on every host over pdsh, and under srun or
mpirun to that launcher, which passes it on. fathom-launch then waits for the runner and ends with its
exit status. A second signal, ECHO_S after the first, goes on to the ranks too, which then end at once.
If fathom-launch itself is killed, the kernel sends the runner SIGTERM (PR_SET_PDEATHSIG), and the ranks,
which watch their launchers (pipeline/safety/launchers.py), stop and save.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from types import FrameType

import psutil

from fathom.pipeline.safety.launchers import LAUNCHER_PID, python_program
from fathom.pipeline.safety.signals import ECHO_S

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """In the runner, before it starts: SIGTERM when fathom-launch ends, however it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def local_ranks(runner: psutil.Process) -> list[psutil.Process]:
    """The ranks DeepSpeed's launch.py started on this machine below the runner."""
    ranks = []
    for process in runner.children(recursive=True):
        try:
            if python_program(process.cmdline()) == "deepspeed.launcher.launch":
                ranks += process.children()
        except psutil.Error:
            continue
    return ranks


def option(args: list[str], name: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` in a command line."""
    for at, arg in enumerate(args):
        if arg == name and at + 1 < len(args):
            return args[at + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def remote_stop(pdsh: psutil.Process, signum: int) -> list[str] | None:
    """The pdsh command that sends `signum` to the ranks on every host of the runner's pdsh launch: the
    children of the launch.py that carries this job's world (its --world_info)."""
    args = pdsh.cmdline()
    hosts, world = option(args, "-w"), next((a for a in args if a.startswith("--world_info=")), None)
    if hosts is None or world is None:
        return None
    # anchored at the interpreter: the shell that runs launch.py (and the one running this) name it too
    launcher = shlex.quote(r"^\S*python\S* -u -m deepspeed\.launcher\.launch " + world.replace("+", r"\+"))
    return ["pdsh", "-S", "-w", hosts, f"pkill -{signum} -P $(pgrep -d, -f {launcher})"]


def stop_ranks(runner: psutil.Process, signum: int) -> None:
    """Sends `signum` to every rank the runner started, by the way it started them."""
    for process in local_ranks(runner):
        try:
            process.send_signal(signum)
        except psutil.Error:
            pass
    for child in runner.children():
        try:
            name = child.name()
            if name in ("pdsh", "pdsh.bin"):  # Debian's pdsh is a script that execs pdsh.bin
                if command := remote_stop(child, signum):
                    subprocess.run(command, env=child.environ(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            elif name in ("srun", "mpirun", "mpiexec", "mpiexec.hydra", "mpirun_rsh"):
                child.send_signal(signum)  # they pass it on to their tasks
        except psutil.Error:
            continue


def run_runner(argv: list[str]) -> int:
    """Runs DeepSpeed's runner with `argv` as fathom-launch's child and returns its exit status, passing
    stop signals on to the ranks meanwhile."""
    env = {**os.environ, LAUNCHER_PID: str(os.getpid())}
    command = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", *argv]
    child = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent)
    runner = psutil.Process(child.pid)
    first: list[float] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if first and now - first[0] < ECHO_S:  # the same stop, passed on to us by whoever sent it
            return
        first[:] = first or [now]
        stop_ranks(runner, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = child.wait()
    return 128 - status if status < 0 else status
