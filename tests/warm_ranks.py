"""Ranks that start warm. A rank's first 15 s on 2 cores are mostly imports that are the same for every
job: torch, DeepSpeed, torch's dynamo (torch's optimizers import it when they are built) and inductor
(DeepSpeed's ZeRO imports its Muon kernels, compiled with torch.compile, to list them as supported). A
server per pytest worker and rank slot imports them once, and each rank of tests.helpers.launch is a
fork of it that then runs its script as `python -u SCRIPT ARGS` would: the job's environment, working
directory, argv, sys.path[0], output files and file size limit, exit status and exit handlers. Ranks 0
and 1 of a job come from two servers, so they hash strings differently, as two interpreters do.

FATHOM_TEST_COLD_RANKS=1 starts every rank as a new interpreter instead.

Run as a script, this file is the server: requests are JSON lines on stdin, replies JSON lines on the
file descriptor named by its argument ({"pid": P} for each rank started, then {"ended": P, "status": S}).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOADED = ("torch", "deepspeed", "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer")
SLOTS = 2
POLL_SECONDS = 0.02


def cold() -> bool:
    return os.environ.get("FATHOM_TEST_COLD_RANKS") == "1"


# The server and its forked ranks


def exit_status(error: SystemExit) -> int:
    """The status an interpreter ends with for `sys.exit(code)`."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def run_rank(request: dict) -> None:
    """In the forked child: becomes `python -u SCRIPT ARGS` started in the request's setting, then exits."""
    import atexit
    import resource
    import runpy

    status = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
                                (2, request["stderr"], os.O_WRONLY | os.O_APPEND)):  # fmt: skip
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        if request["file_size_limit"] is not None:
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (request["file_size_limit"], hard))
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as error:
            status = exit_status(error)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            status = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
        threading._shutdown()  # what an interpreter does at its end: join threads, then the exit handlers
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if status < 0:  # an uncaught Ctrl-C ends an interpreter by the signal itself
            signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        os._exit(status % 256)


def serve(replies: int) -> None:
    for name in PRELOADED:
        importlib.import_module(name)
    pending, running = b"", set()

    def reply(message: dict) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    while True:
        if select.select([0], [], [], POLL_SECONDS)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the pytest worker is gone: so are its ranks
                for pid in running:
                    os.kill(pid, signal.SIGKILL)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    os.close(replies)
                    run_rank(json.loads(line))
                running.add(pid)
                reply({"pid": pid})
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                reply({"ended": pid, "status": os.waitstatus_to_exitcode(status)})


# The pytest side


class Server:
    """One warm server, started on first use and ended with the pytest worker."""

    def __init__(self, env: dict[str, str]) -> None:
        read, write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-u", __file__, str(write)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            pass_fds=(write,),
            env=env,
        )
        os.close(write)
        self.replies = read
        self.pending = b""
        self.ended: dict[int, int] = {}
        self.lock = threading.Lock()

    def messages(self, wait: bool) -> list[dict]:
        if not select.select([self.replies], [], [], None if wait else 0)[0]:
            return []
        chunk = os.read(self.replies, 1 << 16)
        if not chunk:
            raise RuntimeError("the warm-rank server ended; run with FATHOM_TEST_COLD_RANKS=1 to see why")
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        return [json.loads(line) for line in lines]

    def start(self, request: dict) -> int:
        with self.lock:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            while True:
                for message in self.messages(wait=True):
                    if "pid" in message:
                        return message["pid"]
                    self.ended[message["ended"]] = message["status"]

    def status(self, pid: int) -> int | None:
        with self.lock:
            for message in self.messages(wait=False):
                self.ended[message["ended"]] = message["status"]
            return self.ended.get(pid)


SERVERS: dict[int, Server] = {}


class WarmRank:
    """A forked rank, with the part of subprocess.Popen's interface that tests.helpers uses."""

    def __init__(self, server: Server, args: list[str], request: dict) -> None:
        self.server, self.args = server, args
        self.pid = server.start(request)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.status(self.pid)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(POLL_SECONDS)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended and its server reaped it before saying so: as Popen does
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_rank(
    command: list[str], rank: int, cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
    file_size_limit: int | None,
) -> WarmRank:  # fmt: skip
    """Rank `rank` of a job, the `python -u SCRIPT ARGS` of `command`, forked from its slot's warm server."""
    assert command[:2] == [sys.executable, "-u"], command
    for slot in range(SLOTS):  # all of them at once: they import side by side
        if slot not in SERVERS or SERVERS[slot].process.poll() is not None:
            SERVERS[slot] = Server({k: v for k, v in env.items() if not k.startswith("FATHOM_")})
    request = {"script": command[2], "args": command[3:], "cwd": str(cwd), "env": env, "stdout": str(stdout),
               "stderr": str(stderr), "file_size_limit": file_size_limit}  # fmt: skip
    return WarmRank(SERVERS[rank % SLOTS], command, request)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
