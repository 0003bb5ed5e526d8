"""Before a pdsh launch, each host is asked over ssh whether it can start its ranks.

DeepSpeed's runner starts every host's launcher over pdsh in the launch directory with this machine's
interpreter: a host without that directory, that virtualenv or fathom printed `No such file or directory`
(exit 127) among the other hosts' output, and the hosts that did start waited for its ranks until killed.
So the front door runs, on every host at once and as pdsh will (ssh with PDSH_SSH_ARGS_APPEND, --ssh_port,
the launch directory, PYTHONPATH as the runner exports it), the checks the launch needs, and names the
first host that fails and why.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from fathom.common.errors import ConfigError

SSH_TIMEOUT_S = 60
# What each failing check's exit status means (the remote shell's own: 255 is ssh's).
PROBLEMS = {
    10: "no directory {cwd} (the launch directory: every host needs the same path)",
    11: "no Python at {python} (every host needs this interpreter at the same path)",
    12: "fathom does not import with {python}",
    13: "no {program} in {cwd}",
}


def probe(cwd: str, python: str, program: str, module: bool) -> str:
    """The remote shell command: each check exits with its code from PROBLEMS."""
    pythonpath = os.pathsep.join(filter(None, [cwd, os.environ.get("PYTHONPATH")]))  # as the runner exports it
    found = (f"{shlex.quote(python)} -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) "
             f"is None)' {shlex.quote(program)}" if module else f"test -e {shlex.quote(program)}")  # fmt: skip
    return (f"cd {shlex.quote(cwd)} 2>/dev/null || exit 10; test -x {shlex.quote(python)} || exit 11; "
            f"export PYTHONPATH={shlex.quote(pythonpath)}; {shlex.quote(python)} -c 'import fathom.pipeline.train' "
            f">/dev/null 2>&1 || exit 12; {found} || exit 13")  # fmt: skip


def ssh_command(host: str, remote: str, ssh_port: int | None) -> list[str]:
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    options = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20", *options, *port, host, remote]


def host_problem(host: str, remote: str, ssh_port: int | None, context: dict[str, str]) -> str | None:
    try:
        done = subprocess.run(ssh_command(host, remote, ssh_port), capture_output=True, text=True,
                              timeout=SSH_TIMEOUT_S, stdin=subprocess.DEVNULL)  # fmt: skip
    except FileNotFoundError:
        return "no ssh client on this machine (pdsh launches over ssh)"
    except subprocess.TimeoutExpired:
        return f"no answer over ssh within {SSH_TIMEOUT_S} s"
    if done.returncode in PROBLEMS:
        return PROBLEMS[done.returncode].format(**context)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"ssh {host} failed ({said}); pdsh needs passwordless ssh to every host"
    return None


def check_hosts(hosts: list[str], program: str, module: bool, ssh_port: int | None) -> None:
    """Every host can start its ranks (`program`, a script or with `module` a module, from this directory with
    this interpreter), or a ConfigError naming the first that cannot and why."""
    context = {"cwd": os.path.abspath("."), "python": sys.executable, "program": program}
    remote = probe(context["cwd"], context["python"], program, module)
    with ThreadPoolExecutor(max_workers=min(len(hosts), 32)) as pool:
        problems = list(pool.map(lambda host: host_problem(host, remote, ssh_port, context), hosts))
    for host, problem in zip(hosts, problems, strict=True):
        if problem is not None:
            raise ConfigError(f"host {host}: {problem}; nothing was launched")
