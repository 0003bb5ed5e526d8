"""scripts/train.py with a crash injected at an exact point of a checkpoint save, for
tests/test_crash.py. FATHOM_CRASH says where, for one global rank:

    RANK:file:K    in this launch's first save, after K-1 whole files: half of file K, then SIGKILL
    RANK:commit    in this launch's first commit, after the files and the manifest, before `latest` moves

FATHOM_SLOW_SAVE=SECONDS makes every checkpoint save first write SAVE_DIR/saving-TAG, then wait that long.
"""

import os
import signal
import time
from pathlib import Path

import torch

from fathom.pipeline.checkpoint import saving
from fathom.pipeline.train import main
from fathom.pipeline.world.distributed import run_launched


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_mid_file(count: int) -> None:
    original = saving.CommittingCheckpointEngine.save

    def save(self, state_dict, path):
        if len(self.written) == count - 1:
            tmp = Path(path).with_suffix(".whole")
            torch.save(state_dict, tmp)
            data = tmp.read_bytes()
            tmp.unlink()
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            die()
        original(self, state_dict, path)

    saving.CommittingCheckpointEngine.save = save


def crash_before_latest() -> None:
    original = saving.write_atomic

    def write_atomic(path, text):
        if path.name == saving.LATEST:
            die()
        original(path, text)

    saving.write_atomic = write_atomic


def slow_saves(seconds: float) -> None:
    original = saving.save

    def save(engine, save_dir, client_state, best, schedule_step):
        (Path(save_dir) / f"saving-global_step{engine.global_steps}").touch()
        time.sleep(seconds)
        return original(engine, save_dir, client_state, best, schedule_step)

    saving.save = save


if "FATHOM_SLOW_SAVE" in os.environ:
    slow_saves(float(os.environ["FATHOM_SLOW_SAVE"]))
if "FATHOM_CRASH" in os.environ:
    rank, point, *count = os.environ["FATHOM_CRASH"].split(":")
    if int(os.environ["RANK"]) == int(rank):
        if point == "file":
            crash_mid_file(int(count[0]))
        else:
            crash_before_latest()
run_launched(main)
