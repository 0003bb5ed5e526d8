"""One command's wall time and the peak memory of its whole process tree, sampled while it runs: how the
benchmarks that time other programs (data preparation, checkpoint reshaping) measure them.

Peak memory is the sum of RSS over the process and all its descendants, and the sum of PSS, which splits
the pages forked workers share instead of counting them once per worker; sampled every SAMPLE_INTERVAL_S.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from fathom.common.repo import ROOT

SAMPLE_INTERVAL_S = 0.1


@dataclass
class Measured:
    """One command: its wall time and the peak memory of its process tree (bytes; PSS None where the
    kernel does not say)."""

    command: list[str]
    seconds: float = 0.0
    peak_rss: int = 0
    peak_pss: int | None = 0
    log: str = ""


def tree_memory(root: psutil.Process) -> tuple[int, int | None]:
    """Sum of RSS and of PSS over a process and all its descendants, now; processes that end while
    being read count as gone."""
    rss, pss = 0, 0
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for process in processes:
        try:
            if pss is not None:
                try:
                    info = process.memory_full_info()
                    rss, pss = rss + info.rss, pss + info.pss
                    continue
                except psutil.AccessDenied:
                    pss = None
            rss += process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return rss, pss


def run_sampled(name: str, command: list[str], log: Path, env: dict | None = None) -> Measured:
    """Runs `command` from the repository root, its output to `log`,
    sampling its tree's memory every SAMPLE_INTERVAL_S; raises StageError, naming it `name`, if it fails."""
    measured = Measured(command=command, log=str(log))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as log_file:
        tick = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=log_file)
        root = psutil.Process(process.pid)
        try:
            while True:
                rss, pss = tree_memory(root)
                measured.peak_rss = max(measured.peak_rss, rss)
                measured.peak_pss = None if pss is None or measured.peak_pss is None else max(measured.peak_pss, pss)
                try:
                    process.wait(timeout=SAMPLE_INTERVAL_S)
                    break
                except subprocess.TimeoutExpired:
                    continue
        except BaseException:  # interrupted: leave no worker behind
            try:
                tree = [*root.children(recursive=True), root]
            except psutil.NoSuchProcess:
                tree = []
            for member in tree:
                try:
                    member.kill()
                except psutil.NoSuchProcess:
                    pass
            process.wait()
            raise
        measured.seconds = time.perf_counter() - tick
    if process.returncode != 0:
        raise StageError(name, process.returncode, log)
    return measured


class StageError(RuntimeError):
    """A sampled command that exited with an error: its name, status and log."""

    def __init__(self, name: str, returncode: int, log: Path):
        super().__init__(f"{name} exited with status {returncode}; its output: {log}")
        self.log = log


def mib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**20:,.0f} MiB"
