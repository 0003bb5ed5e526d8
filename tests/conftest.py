from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, built_once, prepare_slice

REAL_POPEN_INIT = subprocess.Popen.__init__

# One torch thread in every process of the suite, its jobs and scripts included: the two workers of
# `pytest -n 2` share a 2-core machine, where a process's second OpenMP thread spin-waits against the
# other worker's (the fast tier: 62 s instead of 70; a fairseq-generate of 50 sentences 1.1 s instead of
# 122). A launched rank would get one anyway (cpu_threads splits the cores among a job's ranks).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The fast tier (`-m "not slow"`) starts no process, not even in a fixture it sets up: a test that
    launches a job or a script, or trains, is marked slow (docs/TESTS.md), and this keeps it so."""
    if item.get_closest_marker("slow") is None:

        def refuse(self, args, *rest, **kwargs):
            raise AssertionError(f"{item.nodeid} starts a process ({args!r:.120}): mark it @pytest.mark.slow")

        subprocess.Popen.__init__ = refuse


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    subprocess.Popen.__init__ = REAL_POPEN_INIT


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def process_group(monkeypatch) -> None:
    """torch.distributed for this one process, as scripts/bench.py makes it, for a test that builds
    DeepSpeed's engine in-process. The group outlives the test (torch makes one per process); the
    environment it reads does not: later tests' subprocesses (fairseq-train) would take its port."""
    from fathom.tools.in_process_engine import init_single_process  # imports DeepSpeed: only where it is used

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "")  # what teardown restores
        monkeypatch.delenv(key)
    init_single_process()  # sets them, unless an earlier test made the group
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)  # what DeepSpeed's engine reads beside the group


@pytest.fixture(scope="session")
def multi30k_slice(tmp_path_factory) -> Path:
    """A prepared data directory from a few hundred real Multi30k pairs."""

    def prepare(folder: Path) -> None:
        (folder / "raw").mkdir()
        prepare_slice(folder / "raw", folder / "m30k", pairs=400, valid=60, test=50, vocab_size=400)

    return built_once(tmp_path_factory, "multi30k_slice", prepare) / "m30k"


@pytest.fixture(scope="session")
def fairseq_bin() -> Path:
    """bin/ of the cached fairseq 0.12.2 environment (built on first use: a few minutes)."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_fairseq_env.sh")], capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, f"setting up fairseq failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return Path(result.stdout.strip().splitlines()[-1]) / "bin"
