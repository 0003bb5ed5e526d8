"""Real daemons for tests, each in a temporary directory of its own and stopped with every process it started:
an sshd that two host names reach (pdsh, DeepSpeed's pdsh launcher) and a Slurm cluster of one node (munged,
slurmctld, slurmd). Nothing under ~/.ssh, /etc/ssh, /etc/slurm or /etc/munge is read or written; the only
path outside the temporary directory is /run/sshd, the empty directory a root sshd needs.

A missing program, or a daemon that does not come up, skips the test naming what to install (or the daemon's
log), and fails it where FATHOM_REQUIRE_DAEMONS=1 (CI: .ci/run). Under `pytest -n 2` each worker starts its
own daemons: ports come from the worker's share (helpers.free_port), directories are separate, and the two
clusters' slurmd, both of NodeName `hostname`, share nothing but the name (own port, spool, pid file, munged,
job ids). One cluster shared by the workers would save a few seconds but let one test's jobs, requeues and
cancellations meet the other's, and leave no owner to stop it."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

from fathom.pipeline.launch.supervise import die_with_parent  # so a daemon never outlives a killed worker
from tests.helpers import free_port

REQUIRE = "FATHOM_REQUIRE_DAEMONS"
# The Debian/Ubuntu package of each program (`make daemons` installs them).
PACKAGES = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "pdsh": "pdsh",
            "munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "srun": "slurm-client",
            "sbatch": "slurm-client", "scontrol": "slurm-client", "sinfo": "slurm-client"}  # fmt: skip
HOSTS = ("127.0.0.1", "127.0.0.2")  # two names of this machine: all of 127/8 is loopback, no /etc/hosts entry


def unavailable(message: str) -> NoReturn:
    """Skips the test, or fails it where the environment says every daemon must run (CI)."""
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def programs(*names: str) -> dict[str, str]:
    """Each program's path (sbin directories too, which a user's PATH may lack); skips naming the missing."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = {name: shutil.which(name, path=path) for name in names}
    missing = [name for name, where in found.items() if where is None]
    if missing:
        packages = " ".join(dict.fromkeys(PACKAGES.get(name, name) for name in missing))
        unavailable(f"{', '.join(missing)} not installed: apt-get install {packages} (make daemons does)")
    return {name: str(where) for name, where in found.items()}


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path.name}: none)"


def start(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A daemon run in the foreground, as our child (so it is reaped), its output appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip


def wait_until(ready: Callable[[], bool], what: str, daemons: Iterable[subprocess.Popen], logs: Iterable[Path],
               timeout: float = 20) -> None:  # fmt: skip
    """Polls `ready`; a daemon that exits, or `timeout` seconds, skip (fail) with the tails of `logs`."""
    deadline = time.monotonic() + timeout
    while not ready():
        ended = [d.args[0] for d in daemons if d.poll() is not None]
        if ended or time.monotonic() > deadline:
            why = f"{', '.join(ended)} exited" if ended else f"not within {timeout:g} s"
            unavailable(f"{what} did not come up ({why}):\n" + "\n".join(f"{p}:\n{tail(p)}" for p in logs))
        time.sleep(0.05)


def process_tree() -> dict[int, int]:
    """Every process's parent, by pid."""
    parents = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parents


def with_descendants(roots: Iterable[int]) -> set[int]:
    parents, found = process_tree(), set(roots)
    while True:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        if not more:
            return found
        found |= more


def marked(entry: str) -> set[int]:
    """Processes whose environment holds `entry` (NAME=value): what a daemon, and every process its jobs
    start, carries."""
    needle, pids = entry.encode() + b"\0", set()
    for path in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if needle in path.read_bytes():
                pids.add(int(path.parent.name))
    return pids - {os.getpid()}


def stop(daemons: Iterable[subprocess.Popen], others: Iterable[int] = ()) -> None:
    """Ends `daemons`, last started first (SIGTERM, so that each reaps its helpers; SIGKILL 5 s on), then every
    process that was below them, and `others` and what was below those (SIGKILL)."""
    daemons = list(daemons)
    tree = with_descendants([*(d.pid for d in daemons), *others]) - {os.getpid(), *(d.pid for d in daemons)}
    for daemon in reversed(daemons):
        daemon.terminate()
        try:
            daemon.wait(timeout=5)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def daemon_directory(prefix: str) -> Path:
    """A short directory under /tmp that every user may traverse: munged refuses a socket below a 0700
    directory (pytest's tmp_path is one), and a Unix socket's path must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


@dataclass
class Sshd:
    """A running sshd on `port` of both `hosts`, which logs in as this user with its own key."""

    directory: Path
    port: int
    config: Path  # the ssh client's config (`ssh -F`): port, key, known hosts for Host 127.0.0.*
    hosts: tuple[str, ...] = HOSTS

    def env(self) -> dict[str, str]:
        """What pdsh (and so `deepspeed --hostfile`, whose runner runs `pdsh -S -f 1024 -w HOSTS`) needs to reach
        the hosts: its ssh module puts PDSH_SSH_ARGS_APPEND before `-2 -a -x HOST` on each ssh command line."""
        return {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {self.config}"}

    def ssh(self, host: str, command: str) -> list[str]:
        return ["ssh", "-F", str(self.config), host, command]

    def pdsh(self, command: str, hosts: Iterable[str] = HOSTS) -> list[str]:
        return ["pdsh", "-S", "-w", ",".join(hosts), command]

    def hostfile(self, path: Path, slots: int = 1) -> Path:
        """A DeepSpeed hostfile of both hosts, `slots` ranks each."""
        path.write_text("".join(f"{host} slots={slots}\n" for host in self.hosts))
        return path

    def run(self, command: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(command, env={**os.environ, **self.env()}, capture_output=True, text=True,
                              timeout=timeout, **kwargs)  # fmt: skip


@contextlib.contextmanager
def running_sshd(remote_env: dict[str, str] | None = None) -> Iterator[Sshd]:
    """An sshd of its own (under a second to start, with its keys and a login to each host) on a free port of
    127.0.0.1 and 127.0.0.2, root login by key only, stopped at exit with every session and remote process
    below it. `remote_env` is set in every session's environment (sshd's SetEnv; not PATH, which sshd sets).

    A remote command runs as sshd runs it: `bash -c COMMAND` (bash execs a last simple command itself) in the
    home directory, with sshd's PATH (root's: /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
    and what ~/.bashrc adds (Debian's bash reads it for ssh commands), never the test's environment.
    DeepSpeed's pdsh launch reaches its ranks with an absolute sys.executable, a `cd` to the launch directory,
    PYTHONPATH with that directory, and `export`s of the variables named PYTHON*, UCX*, MLFLOW*, MV2* and of
    each line of ~/.deepspeed_env and ./.deepspeed_env: so a test writes PATH (DeepSpeed builds its CPU op
    with the environment's ninja), OMP_NUM_THREADS and TORCH_EXTENSIONS_DIR into ./.deepspeed_env in the
    launch directory. The runner's own ssh calls take no PDSH_SSH_ARGS_APPEND: launch with `--no_ssh_check
    --master_addr 127.0.0.1`, or it runs `ssh HOST hostname` (and `hostname -I`) on port 22 and stops."""
    tools = programs("sshd", "ssh", "ssh-keygen", "pdsh")
    directory = daemon_directory("fathom-sshd-")
    daemons: list[subprocess.Popen] = []
    try:
        for key in ("host_key", "client_key"):
            subprocess.run([tools["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-C", key, "-f", directory / key],
                           check=True, capture_output=True)  # fmt: skip
        shutil.copy(directory / "client_key.pub", directory / "authorized_keys")
        port, log = free_port(), directory / "sshd.log"
        settings = [*(f"ListenAddress {host}:{port}" for host in HOSTS), f"HostKey {directory / 'host_key'}",
                    f"AuthorizedKeysFile {directory / 'authorized_keys'}", "StrictModes no",
                    "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no", "UsePAM no", f"PidFile {directory / 'sshd.pid'}",
                    "MaxStartups 100", "MaxSessions 100", "LogLevel VERBOSE",
                    *(f'SetEnv {name}="{value}"' for name, value in (remote_env or {}).items())]  # fmt: skip
        (directory / "sshd_config").write_text("".join(line + "\n" for line in settings))
        config = directory / "ssh_config"
        config.write_text(f"Host 127.0.0.*\n  Port {port}\n  IdentityFile {directory / 'client_key'}\n"
                          f"  IdentitiesOnly yes\n  UserKnownHostsFile {directory / 'known_hosts'}\n"
                          "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n")  # fmt: skip
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        daemons.append(start([tools["sshd"], "-D", "-f", str(directory / "sshd_config"), "-E", str(log)], log))
        sshd = Sshd(directory, port, config)

        def logs_in() -> bool:
            return all(subprocess.run([tools["ssh"], "-F", str(config), host, "true"], capture_output=True,
                                      timeout=20).returncode == 0 for host in HOSTS)  # fmt: skip

        wait_until(logs_in, "sshd", daemons, [log])
        yield sshd
    finally:
        stop(daemons)
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Slurm:
    """A running Slurm cluster of one node, `node` (this machine's host name) with `cpus` CPUs in partition
    `debug`; the Slurm commands reach it through env()'s SLURM_CONF."""

    directory: Path
    conf: Path
    node: str
    cpus: int
    logs: list[Path] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment for a Slurm command, with env() and `extra`, less the variables of a
        Slurm job pytest itself may run in (they would make srun a step of that job)."""
        ours = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        return {**ours, **self.env(), **(extra or {})}

    def run(self, *command: str, check: bool = True, timeout: float = 60, env: dict[str, str] | None = None,
            **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
        """A command (srun, scontrol, ...) in this cluster, `env` added to environ(); `check`: a non-zero exit
        fails with its output."""
        result = subprocess.run(command, env=self.environ(env), capture_output=True, text=True, timeout=timeout,
                                **kwargs)  # fmt: skip
        assert not check or result.returncode == 0, f"{' '.join(command)}: {result.returncode}\n" + (
            result.stdout[-3000:] + result.stderr[-3000:]
        )
        return result

    def sbatch(self, script: str | Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """Submits a batch script (a file, or its text) with sbatch's `args`; its job id. The job runs in `cwd`
        (default: the cluster's directory), where its output goes, slurm-JOBID.out unless --output says."""
        if isinstance(script, str):
            path = Path(tempfile.mkstemp(suffix=".sh", dir=self.directory)[1])
            path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
            script = path
        cwd = cwd or self.directory
        out = self.run("sbatch", "--parsable", *args, str(script), cwd=cwd, env=env).stdout
        return out.strip().split(";")[0]

    def output(self, job_id: str, cwd: Path | None = None) -> str:
        """What a job wrote to its default output file so far."""
        path = (cwd or self.directory) / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o JOB` as a dict (JobState, Restarts, ExitCode, Reason, RunTime, ...)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip()
        return dict(re.findall(r"(\S+?)=(.*?)(?= \S+?=|$)", line))

    def job_state(self, job_id: str) -> str:
        return self.job(job_id)["JobState"]

    def wait_state(self, job_id: str, states: str | Iterable[str], timeout: float = 60) -> str:
        """Waits until the job is in one of `states` (e.g. RUNNING, PENDING, COMPLETED, FAILED, CANCELLED,
        TIMEOUT); the state reached. Past `timeout` fails with the job's record and the daemons' logs."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline, record = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record["JobState"] in wanted:
                return record["JobState"]
            time.sleep(0.1)
        wanted_text = "/".join(sorted(wanted))
        raise AssertionError(f"job {job_id} not {wanted_text} in {timeout:g} s: {record}\n{self.log_tails()}")

    def scancel(self, job_id: str, signal: str | None = None, batch: bool = False, full: bool = False) -> None:
        """scancel JOB; with `signal` (TERM, USR1, ...) only signals it: its steps' tasks, not the batch shell nor
        srun (`batch`: the batch shell alone; `full`: the shell, srun and the tasks, where srun turns a TERM
        into its tasks' SIGKILL)."""
        flags = [f"--signal={signal}"] * bool(signal) + ["--batch"] * batch + ["--full"] * full
        self.run("scancel", *flags, job_id)

    def requeue(self, job_id: str) -> None:
        self.run("scontrol", "requeue", job_id)

    def log_tails(self) -> str:
        return "\n".join(f"{path}:\n{tail(path)}" for path in self.logs)


@contextlib.contextmanager
def running_slurm(
    cpus: int | None = None, kill_wait: int = 10, requeue_delay: int = 5, requeue_exit: bool = True
) -> Iterator[Slurm]:
    """munged, slurmctld and slurmd of their own (about 1 s to start, until sinfo shows the node idle),
    stopped at exit with every process of their jobs, and every process started with their SLURM_CONF (srun,
    sbatch, batch shells, tasks). The node has `cpus` CPUs (default: at least 4, whatever the machine has:
    the tasks share its cores). A job asked to stop (scancel, scontrol requeue, its time limit) gets SIGTERM,
    then SIGKILL `kill_wait` s later; time limits are enforced by a check every 30 s, up to 30 s late. A
    batch job that exits 75 (RequeueExit) or is requeued runs again `requeue_delay` + 1 s after it ended
    (AuthInfo's cred_expire, which Slurm takes from 5 s up; the scheduler runs every second), later while
    another job on the node is still completing; its output file restarts unless --open-mode=append. Without
    `requeue_exit` (RequeueExit=75), as on most clusters, a job exiting 75 ends as any failed job does."""
    if requeue_delay < 5:
        raise ValueError(f"requeue_delay {requeue_delay}: Slurm refuses a cred_expire under 5 s (and waits 120)")
    tools = programs("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo")
    directory = daemon_directory("fathom-slurm-")
    conf, node = directory / "slurm.conf", socket.gethostname().split(".")[0]
    cpus = cpus or max(4, os.cpu_count() or 1)
    # Daemons and every process a client of this cluster starts carry it: what stop() ends.
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen] = []
    try:
        for name in ("state", "spool", "munge"):
            (directory / name).mkdir(mode=0o755)
        key, munge_socket = directory / "munge" / "munge.key", directory / "munge" / "socket"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # slurmd's own log file also holds slurmstepd's; in the foreground it writes each line to stderr too
        logs = [directory / name for name in ("munged.log", "slurmctld.log", "slurmd.log", "slurmd.stderr")]
        daemons.append(start([tools["munged"], "--foreground", f"--key-file={key}", f"--socket={munge_socket}",
                              f"--pid-file={directory / 'munge' / 'pid'}", f"--log-file={logs[0]}",
                              f"--seed-file={directory / 'munge' / 'seed'}", "--force"], logs[0], env))  # fmt: skip
        wait_until(munge_socket.exists, "munged", daemons, logs[:1])
        memory_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**21  # half the machine's
        first_job = 1000 * random.randrange(1, 60000)  # this cluster's job ids are its own
        ports = [free_port()]
        while len(ports) < 2:
            ports += {free_port()} - set(ports)
        settings = {
            "ClusterName": f"fathom{os.getpid()}", "SlurmctldHost": f"{node}(127.0.0.1)", "SlurmUser": "root",
            "SlurmdUser": "root", "SlurmctldPort": ports[0], "SlurmdPort": ports[1],
            "AuthType": "auth/munge", "CredType": "cred/munge",
            "AuthInfo": f"socket={munge_socket},cred_expire={requeue_delay}",
            "StateSaveLocation": directory / "state", "SlurmdSpoolDir": directory / "spool",
            "SlurmctldPidFile": directory / "slurmctld.pid", "SlurmdPidFile": directory / "slurmd.pid",
            "SlurmdLogFile": logs[2], "MailProg": "/bin/true",
            "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none", "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU", "SchedulerType": "sched/builtin",
            "SchedulerParameters": "sched_interval=1", "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none", "JobCompType": "jobcomp/none", "MpiDefault": "none",
            "SwitchType": "switch/none", "JobRequeue": 1, "KillWait": kill_wait,
            # Records of ended jobs stay 5 min, for wait_state and job() to read; the daemons end sooner.
            "MinJobAge": 300, "OverTimeLimit": 0, "ReturnToService": 2, "FirstJobId": first_job,
            # The node's configured CPUs count, not the hardware's (fewer cores would drain it).
            "SlurmdParameters": "config_overrides", "TmpFS": directory,
            "NodeName": f"{node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
            "PartitionName": f"debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        }  # fmt: skip
        if requeue_exit:
            settings["RequeueExit"] = 75
        conf.write_text("".join(f"{name}={value}\n" for name, value in settings.items()))
        daemons.append(start([tools["slurmctld"], "-D", "-i", "-f", str(conf)], logs[1], env))
        daemons.append(start([tools["slurmd"], "-D", "-f", str(conf)], logs[3], env))
        slurm = Slurm(directory, conf, node, cpus, logs)

        def idle() -> bool:
            command = [tools["sinfo"], "-h", "-n", node, "-o", "%T"]
            return subprocess.run(command, env=slurm.environ(), capture_output=True, text=True).stdout.strip() == "idle"

        wait_until(idle, "Slurm (munged, slurmctld, slurmd)", daemons, logs)
        yield slurm
    finally:
        stop(daemons, marked(f"SLURM_CONF={conf}"))
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def sshd() -> Iterator[Sshd]:
    """An sshd of its own that 127.0.0.1 and 127.0.0.2 reach (running_sshd); mark the test slow."""
    with running_sshd() as server:
        yield server


@pytest.fixture
def slurm() -> Iterator[Slurm]:
    """A Slurm cluster of one node (running_slurm); mark the test slow."""
    with running_slurm() as cluster:
        yield cluster
