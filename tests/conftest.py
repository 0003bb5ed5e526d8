from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str | Path, *args: str, processes: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs a script under the real `deepspeed` launcher with `processes` CPU ranks."""
    launcher = shutil.which("deepspeed")
    assert launcher, "the deepspeed launcher is not on PATH"
    cmd = [launcher, "--num_gpus", str(processes), "--master_port", str(free_port()), str(script), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-6000:] + result.stderr[-6000:])
    return result


@pytest.fixture
def root() -> Path:
    return ROOT
