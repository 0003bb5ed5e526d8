"""Cluster launches on one machine: two hostfile "nodes" without ssh, mpirun, and deepspeed's openmpi
launcher each train the default job exactly as one `deepspeed --num_gpus 2` launcher does."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, assert_same_training, final_layers, free_port, logged_steps

pytestmark = pytest.mark.slow

TRAIN = ["scripts/train.py", "--config", "ds_configs/default.json", "--override", "train.max_steps=4"]
# A constant learning rate (no warmup from 0), so every one of the 4 steps moves the weights.
OVERRIDES = ["train.save_interval=2", "train.log_interval=1", "scheduler.params.warmup_min_lr=0.001"]
# Every run gets the same thread count: matmul reductions split differently over 2 threads than over 1
# (measured: weights 1 ulp apart after 4 steps, up to 3e-8), and bit-identical weights are the claim.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TIMEOUT = 600


def train_command(save_dir: Path) -> list[str]:
    return [*TRAIN, *OVERRIDES, f"train.save_dir={save_dir}"]


def run(cmd: list[str], env: dict[str, str] = ENV) -> str:
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def assert_same_run(expected: Path, actual: Path) -> None:
    assert_same_training(expected, actual)
    assert len(logged_steps(expected)) == 4 and len(final_layers(expected)) == 27


@pytest.fixture(scope="module")
def one_launcher_run(tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("one_launcher")
    run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), *train_command(save_dir)])
    return save_dir


def mpirun_flags() -> list[str]:
    assert shutil.which("mpirun"), "mpirun not found: apt-get install openmpi-bin libopenmpi-dev (make install does)"
    # Open MPI refuses to run as root without it (CI runs as root).
    return ["--allow-run-as-root"] if os.geteuid() == 0 else []


def test_two_nodes_from_a_hostfile_train_like_one_launcher(tmp_path, one_launcher_run):
    """Stage 0 on "node" worker-0, stage 1 on worker-1: one launcher per node, as on a cluster without ssh."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    save_dir, port = tmp_path / "run", str(free_port())
    launchers = [
        subprocess.Popen(
            ["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node)]
            + ["--master_addr", "127.0.0.1", "--master_port", port, *train_command(save_dir)],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [launcher.communicate(timeout=TIMEOUT)[0] for launcher in launchers]
    for launcher, output in zip(launchers, outputs, strict=True):
        assert launcher.returncode == 0, output[-6000:]
    assert "{'worker-0': [0], 'worker-1': [1]}" in outputs[1]  # node 1's launcher started global rank 1
    placement = json.loads((save_dir / "memory.json").read_text())
    assert [(p["rank"], p["stage"]) for p in placement] == [(0, 0), (1, 1)]
    assert_same_run(one_launcher_run, save_dir)


def test_mpirun_trains_like_one_launcher(tmp_path, one_launcher_run):
    save_dir = tmp_path / "run"
    # DeepSpeed's MPI discovery takes the rendezvous port from train.py, which reads MASTER_PORT.
    env = {**ENV, "MASTER_PORT": str(free_port())}
    cmd = ["mpirun", *mpirun_flags(), "--oversubscribe", "-np", "2", sys.executable, *train_command(save_dir)]
    run(cmd, env)
    assert_same_run(one_launcher_run, save_dir)


def test_deepspeed_openmpi_launcher_trains_like_one_launcher(tmp_path, one_launcher_run):
    """Through scripts/launch.py, which checks the hostfile and execs the same deepspeed command."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    save_dir = tmp_path / "run"
    env = {**ENV, "MASTER_PORT": str(free_port())}
    # One host takes the local path unless --force_multi; this machine has no sshd for the runner's ssh
    # check, nor for its `ssh HOST hostname -I` when no --master_addr is given. The runner adds
    # `--mca btl_tcp_if_include eth0` unless the launcher args name an interface.
    mpi_args = " ".join([*mpirun_flags(), "--mca", "btl_tcp_if_include", "lo"])
    launcher = ["--launcher", "openmpi", "--hostfile", str(hostfile), "--force_multi", "--no_ssh_check"]
    launcher += ["--master_addr", "127.0.0.1", f"--launcher_args={mpi_args}"]
    output = run([sys.executable, "scripts/launch.py", *launcher, *train_command(save_dir)], env)
    assert "cmd = mpirun -n 2 -hostfile" in output
    assert_same_run(one_launcher_run, save_dir)
