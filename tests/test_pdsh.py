"""A 2-host launch over pdsh and a real sshd (tests/daemons.py), through fathom-launch: it checks every host
over ssh before launching, a Ctrl-C reaches the ranks as a stop that saves (and its line reaches the
terminal), a killed pdsh leaves no rank training, and the run resumed on this machine ends bit-equal to
one never stopped."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from fathom.common.run_layout import latest_tag
from fathom.pipeline.safety.signals import RESUMABLE_EXIT
from tests import daemons
from tests.helpers import ROOT, assert_same_training, free_port, launch, wait_for_release
from tests.test_crash import OVERRIDES, steps_done
from tests.test_stopping import training, wait_for

pytestmark = pytest.mark.slow

TRAIN = ROOT / "scripts" / "train.py"
STEPS = 12
sshd = daemons.sshd  # the fixture


def args(save_dir: Path, steps: int) -> list[str]:
    return ["--config", str(ROOT / "ds_configs" / "default.json"), "--override", *OVERRIDES,
            f"train.max_steps={steps}", f"train.save_dir={save_dir}", "--resume"]  # fmt: skip


def front_door(sshd: daemons.Sshd, hostfile: Path, save_dir: Path, steps: int = 100000) -> list[str]:
    """fathom-launch over pdsh; DeepSpeed's runner's own ssh calls take no PDSH_SSH_ARGS_APPEND, so no ssh check
    of its own and the master's address given."""
    return [sys.executable, str(ROOT / "scripts" / "launch.py"), "--hostfile", str(hostfile), "--no_ssh_check",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(TRAIN),
            *args(save_dir, steps)]  # fmt: skip


def started(sshd: daemons.Sshd, command: list[str], cwd: Path) -> subprocess.Popen:
    # the remote ranks get what ./.deepspeed_env names (one thread each, as the comparison run)
    (cwd / ".deepspeed_env").write_text("OMP_NUM_THREADS=1\n")
    environment = {**os.environ, **sshd.env(), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, cwd=cwd, env=environment, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_a_pdsh_launch_stops_with_a_save_on_ctrl_c_and_resumes_to_the_uninterrupted_weights(sshd, tmp_path):
    """Under pdsh a Ctrl-C ended the job, but fathom's "continues from" line never reached the terminal, and
    once in two tries a node's launcher and rank kept running for over 60 s after it."""
    expected, run = tmp_path / "expected", tmp_path / "run"
    assert launch(TRAIN, *args(expected, STEPS), env={"OMP_NUM_THREADS": "1"}).returncode == 0
    hostfile = sshd.hostfile(tmp_path / "hostfile")
    launcher = started(sshd, front_door(sshd, hostfile, run), tmp_path)
    try:
        wait_for(lambda: steps_done(run) >= 4)
        os.killpg(launcher.pid, signal.SIGINT)  # the terminal's Ctrl-C, to fathom-launch's process group
        output, _ = launcher.communicate(timeout=120)
        wait_for(lambda: not training(run), timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    step = steps_done(run)
    assert launcher.returncode == RESUMABLE_EXIT and "Traceback" not in output, output[-4000:]
    assert "fathom: checked; launching 2 processes" in output
    assert f"fathom: stopped by SIGINT after step {step}; the same command with --resume continues from " \
           f"global_step{step}" in output, output[-4000:]  # fmt: skip
    assert latest_tag(run) == f"global_step{step}"
    wait_for_release(run)
    assert launch(TRAIN, *args(run, STEPS), env={"OMP_NUM_THREADS": "1"}).returncode == 0
    assert_same_training(expected, run)


def test_a_killed_pdsh_leaves_no_rank_training(sshd, tmp_path):
    """`kill` of pdsh: its ssh clients live on and the remote ranks kept training headless. Now they find no one
    reading their output, save and stop."""
    run = tmp_path / "run"
    hostfile = sshd.hostfile(tmp_path / "hostfile")
    launcher = started(sshd, front_door(sshd, hostfile, run), tmp_path)
    try:
        wait_for(lambda: steps_done(run) >= 4)
        pdsh = next(p for p in psutil.Process(launcher.pid).children(recursive=True) if p.name().startswith("pdsh"))
        pdsh.terminate()
        wait_for(lambda: not training(run), timeout=60)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
    assert latest_tag(run) == f"global_step{steps_done(run)}" and not list(run.glob("heartbeat-*"))


def test_a_host_that_cannot_start_its_ranks_is_named_before_anything_launches(sshd, tmp_path):
    """A host without the virtualenv or the checkout printed `No such file or directory` (exit 127) and the other
    node waited for it until killed; the front door had said "checked". Now it asks each host over ssh first."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.3 slots=1\n")  # loopback too, but sshd does not listen there
    launcher = started(sshd, front_door(sshd, hostfile, tmp_path / "run"), tmp_path)
    output, _ = launcher.communicate(timeout=120)
    errors = [line for line in output.splitlines() if line.startswith("fathom: error")]
    assert launcher.returncode == 2 and len(errors) == 1, output[-3000:]
    assert re.fullmatch(r"fathom: error: host 127\.0\.0\.3: ssh 127\.0\.0\.3 failed \(.*\); pdsh needs passwordless "
                        r"ssh to every host; nothing was launched", errors[0]), errors  # fmt: skip
    assert not (tmp_path / "run").exists() and "launching" not in output
