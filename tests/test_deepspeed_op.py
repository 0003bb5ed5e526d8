"""DeepSpeed's CPU op (pipeline/world/deepspeed_op.py): built in a directory of each Python environment's own,
with that environment's ninja, and a lock left by a build that was killed named in one line rather than waited
on forever."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from fathom.common.errors import ConfigError
from fathom.pipeline.world.deepspeed_op import (
    VARIABLE,
    WatchedBaton,
    environment_extensions_dir,
    environment_ninja,
    ninja_on_path,
    use_environment_extensions_dir,
    wait_for_build,
    watched_builds,
)

OP = "deepspeed_shm_comm"
# Takes the lock as torch's FileBaton does (and holds it open, as a builder does), until a line on stdin.
HOLD_LOCK = (
    "import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); "
    "sys.stdin.readline(); os.close(fd); os.remove(sys.argv[1])"
)
# What a CPU rank will run before deepspeed.init_distributed, then DeepSpeed's own step, which must find it loaded.
PREPARE = (
    "import sys\nfrom fathom.common.errors import exit_on_config_error\n"
    "from fathom.pipeline.world.deepspeed_op import prepare_cpu_op\n"
    "with exit_on_config_error():\n    prepare_cpu_op(float(sys.argv[1]))\n"
    "from deepspeed.comm.torch import build_shm_op\nprint('loaded', build_shm_op().__file__, flush=True)\n"
)
PRINT_DIRECTORY = "from fathom.pipeline.world.deepspeed_op import use_environment_extensions_dir as u; print(u())"
# what sshd gives a command: no activated environment, none of the launching shell's variables
SSHD_PATH = "/usr/local/bin:/usr/bin:/bin"


def without_extensions_dir() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != VARIABLE}


def sshd_environment() -> dict[str, str]:
    return {"PATH": SSHD_PATH, "HOME": os.environ["HOME"], "OMP_NUM_THREADS": "1"}


def run_python(python: str | Path, code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([str(python), "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def printed_directory(python: str | Path, env: dict[str, str]) -> str:
    """The build root a process of that Python finds (after DeepSpeed's own lines on stdout)."""
    return run_python(python, PRINT_DIRECTORY, env).stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def built_op() -> Path:
    """The op as this environment's ranks find it, built as `make install` builds it (about a minute, once)."""
    result = subprocess.run([sys.executable, "-m", "fathom.pipeline.world.deepspeed_op"], env=without_extensions_dir(),
                            capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Path(re.findall(r"fathom: DeepSpeed's CPU op is built in (.+)", result.stdout)[-1])


def test_each_environment_builds_the_op_in_its_own_directory(tmp_path):
    """Before, every environment of one Python version built the op in ~/.cache/torch_extensions/py311_cpu: a run
    from another environment (another torch, another ninja) rebuilt what the previous one built, about a minute
    each, 4.5 minutes when it queued behind another's build."""
    (tmp_path / "env_a").mkdir()
    (tmp_path / "env_b").mkdir()
    (tmp_path / "link_to_a").symlink_to(tmp_path / "env_a")
    env_a, env_b = str(tmp_path / "env_a"), str(tmp_path / "env_b")
    root = environment_extensions_dir(env_a)
    assert root == environment_extensions_dir(env_a) == environment_extensions_dir(str(tmp_path / "link_to_a"))
    assert root != environment_extensions_dir(env_b)
    assert root.parent == Path(cpp_extension.get_default_build_root())  # beside torch's own default
    assert environment_extensions_dir() == environment_extensions_dir(sys.prefix)

    environ: dict[str, str] = {}
    assert use_environment_extensions_dir(environ, env_a) == root and environ == {VARIABLE: str(root)}
    # exported by a process of the same environment, or inherited from one of another
    assert use_environment_extensions_dir(environ, env_a) == root and environ == {VARIABLE: str(root)}
    assert use_environment_extensions_dir(environ, env_b) == environment_extensions_dir(env_b)
    assert environ == {VARIABLE: str(environment_extensions_dir(env_b))}
    # a user's choice stands; an empty value is no choice (torch would build under the working directory)
    mine = {VARIABLE: str(tmp_path / "mine")}
    assert use_environment_extensions_dir(mine, env_a) == tmp_path / "mine"
    assert mine == {VARIABLE: str(tmp_path / "mine")}
    empty = {VARIABLE: ""}
    assert use_environment_extensions_dir(empty, env_a) == root and empty == {VARIABLE: str(root)}


def test_a_lock_no_build_holds_fails_in_one_line_within_the_timeout(tmp_path):
    """Before, torch's FileBaton.wait polled for the lock to go, forever and without a word: a rank killed while
    it built left the lock, and every later start hung silently in deepspeed.init_distributed."""
    lock = tmp_path / OP / "lock"
    lock.parent.mkdir()
    lock.touch()
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        wait_for_build(lock, timeout=2, poll=0.1)
    assert 2 <= time.monotonic() - started < 10
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{lock}: held for ")
    assert "remove the lock if no build is running" in message
    # one left long ago fails at once, saying how long
    long_ago = time.time() - 3 * 3600
    for path in (lock, lock.parent):
        os.utime(path, (long_ago, long_ago))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"lock: held for 3\.0 h .* unchanged for 3\.0 h"):
        wait_for_build(lock, timeout=60, poll=0.1)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("builder", ["this machine", "another machine"])
def test_a_running_build_is_waited_for_past_the_timeout(tmp_path, capsys, builder):
    """A build longer than the timeout is not a stale lock: one that a process on this machine holds (here this
    test's own), or one on another machine sharing the directory whose files still change. Before, the wait said
    nothing however long it took."""
    lock = tmp_path / OP / "lock"
    lock.parent.mkdir()
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)
    if builder == "another machine":
        os.close(fd)  # no process here holds it
    stop = threading.Event()

    def build() -> None:  # writes its objects for 3 s, then releases
        for step in range(30):
            if builder == "another machine" and step % 3 == 0:
                (lock.parent / f"part{step}.o").touch()
            stop.wait(0.1)
        if builder == "this machine":
            os.close(fd)
        lock.unlink()

    thread = threading.Thread(target=build)
    started = time.monotonic()
    thread.start()
    wait_for_build(lock, timeout=1, poll=0.1)
    thread.join()
    assert time.monotonic() - started >= 3
    said = capsys.readouterr().out
    if builder == "this machine":
        assert f"fathom: waiting for process {os.getpid()} (" in said
        assert f") building DeepSpeed's CPU op in {lock.parent}; its lock held for " in said
    else:
        assert f"fathom: waiting for the build of DeepSpeed's CPU op in {lock.parent}: no process on this " in said


def test_torch_takes_its_build_lock_by_the_name_fathom_replaces():
    """torch's _jit_compile must still look FileBaton up in its module at each build: under a torch that did not,
    the watch would not apply and a dead lock would hang starts again."""
    assert "FileBaton" in cpp_extension._jit_compile.__code__.co_names
    torchs = cpp_extension.FileBaton
    with watched_builds(5.0):
        baton = cpp_extension.FileBaton("lock")
        assert isinstance(baton, WatchedBaton) and baton.timeout == 5.0
    assert cpp_extension.FileBaton is torchs


def test_the_build_runs_this_environments_ninja_whatever_path_says(monkeypatch):
    """Before, a rank started over ssh (sshd's PATH) built with the system's ninja, 1.11 here, which reads the
    build log of the environment's 1.13 as commands changed: each rebuilt the op the other built (31 s, 35 s)."""
    ninja = environment_ninja()
    assert ninja, "DeepSpeed requires the ninja package"
    monkeypatch.setenv("PATH", SSHD_PATH)
    with ninja_on_path():
        assert os.path.realpath(shutil.which("ninja") or "") == ninja
    assert os.environ["PATH"] == SSHD_PATH


@pytest.mark.slow
def test_a_rank_killed_mid_build_fails_the_next_start_in_one_line(tmp_path):
    """Before, the lock a killed rank left made the next start wait in deepspeed.init_distributed forever,
    silently; now it ends within its timeout with the one line that names the lock."""
    env = {**os.environ, VARIABLE: str(tmp_path / "extensions")}
    lock = tmp_path / "extensions" / OP / "lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline() == "held\n"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock.exists()
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", PREPARE, "3"], env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 2 and time.monotonic() - started < 60, result.stdout + result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"fathom: error: {lock}: held for ") and "remove the lock" in line
    assert "loaded" not in result.stdout


@pytest.mark.slow
def test_a_build_that_finishes_is_waited_for_and_the_op_then_loads(tmp_path, built_op):
    """Another process's build is waited for past the timeout while it holds the lock, then the op loads from
    its directory without a rebuild, and DeepSpeed's own build_shm_op finds it loaded."""
    directory = tmp_path / "extensions" / OP
    shutil.copytree(built_op, directory, ignore=shutil.ignore_patterns("lock", ".ninja_lock"))
    library = directory / f"{OP}.so"
    built = library.stat().st_mtime_ns
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(directory / "lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline() == "held\n"
    env = {**os.environ, VARIABLE: str(tmp_path / "extensions")}
    start = subprocess.Popen([sys.executable, "-c", PREPARE, "1"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    guard = threading.Timer(180, start.kill)  # a start that neither waits aloud nor ends fails, not hangs
    guard.start()
    try:
        lines = []
        while not (line := start.stdout.readline()).startswith(f"fathom: waiting for process {holder.pid} "):
            assert line, "".join(lines)
            lines.append(line)
        holder.communicate("\n", timeout=30)  # the build finishes
        output = start.communicate(timeout=120)[0]
    finally:
        guard.cancel()
    assert start.returncode == 0, output
    assert f"loaded {library}" in output and library.stat().st_mtime_ns == built


@pytest.mark.slow
def test_another_environment_or_an_ssh_start_finds_its_own_directory(tmp_path, built_op):
    """A real second environment (a venv) gets its own directory, whether or not a parent in this one exported
    its own; a start over ssh (sshd's PATH and environment) finds this environment's, built, and builds nothing."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / "venv")],
                   check=True, timeout=120)  # fmt: skip
    venv_python = tmp_path / "venv" / "bin" / "python"
    ours = printed_directory(sys.executable, without_extensions_dir())
    assert Path(ours) == built_op.parent
    exported = {**without_extensions_dir(), VARIABLE: ours}
    assert printed_directory(sys.executable, exported) == ours
    venvs = printed_directory(venv_python, without_extensions_dir())
    assert venvs != ours and Path(venvs).parent == Path(ours).parent
    assert printed_directory(venv_python, exported) == venvs

    library = built_op / f"{OP}.so"
    built = library.stat().st_mtime_ns
    started = time.monotonic()
    over_ssh = run_python(sys.executable, "from fathom.pipeline.world.deepspeed_op import main; main()",
                          sshd_environment())  # fmt: skip
    assert f"fathom: DeepSpeed's CPU op is built in {built_op}" in over_ssh.stdout
    assert "compiling" not in over_ssh.stdout and library.stat().st_mtime_ns == built
    assert time.monotonic() - started < 30  # a rebuild takes a minute
