"""DeepSpeed's pipeline engine built in this one process, at one stage, as scripts/train.py builds it: for
the benchmarks that time it beside a plain loop and the tests that drive it without launching ranks; and
the check that a device is one this machine has, and the one DeepSpeed's engine would run on.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from fathom.common.errors import ConfigError
from fathom.common.ports import free_port
from fathom.model.model_config import ModelConfig
from fathom.pipeline.config.deepspeed_values import check_deepspeed
from fathom.pipeline.config.engine_defaults import deepspeeds_own
from fathom.pipeline.config.run_config import DataConfig, RunConfig, TrainConfig
from fathom.pipeline.engine.internals import clear_pipe_buffers
from fathom.pipeline.train import build_engine
from fathom.pipeline.world.deepspeed_op import prepare_cpu_op
from fathom.pipeline.world.distributed import release_shm_buffer


def init_single_process(device: str = "cpu") -> None:
    """torch.distributed for this one process (world size 1; gloo on a CPU, nccl on a GPU), which the
    engine needs. Not pipeline.world.distributed.init_distributed: that one sets torch's thread count for
    launched ranks, and here every system must run with the same threads."""
    if dist.is_initialized():
        return
    # DeepSpeed's engine places itself on its accelerator's device LOCAL_RANK: cuda:N's N.
    local_rank = torch.device(device).index or 0
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
        "LOCAL_RANK": str(local_rank),
    })  # fmt: skip
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        deepspeed.init_distributed(dist_backend="nccl")
        return
    prepare_cpu_op()  # in this environment's build directory, never waiting on a dead build's lock
    deepspeed.init_distributed(dist_backend="gloo")
    release_shm_buffer()  # DeepSpeed's CPU all-reduce segment in /dev/shm, which it never removes


@contextlib.contextmanager
def built_engine(
    cfg: ModelConfig, ds: dict[str, Any], device: str, deepspeeds: bool = False
) -> Iterator[deepspeed.PipelineEngine]:
    """scripts/train.py's engine of `cfg` with DeepSpeed config `ds` at one stage, in this process, on its
    accelerator's device (init_single_process puts that on `device`); train_batch moves batches there.
    `deepspeeds`: built with DeepSpeed's own values where fathom picks others for speed (engine_defaults'
    deepspeeds_own), once `ds` passed the run's checks, which refuse one of them (the throughput timer)."""
    init_single_process(device)
    check_deepspeed(ds, cfg, world_size=1)
    if deepspeeds:
        ds = deepspeeds_own(ds)
    # DeepSpeed prints its layer list and bf16 memory reports while it builds the engine: not here.
    with contextlib.redirect_stdout(io.StringIO()):
        engine = build_engine(RunConfig(model=cfg, data=DataConfig(), train=TrainConfig(), deepspeed=ds))
    yield engine
    # The engine keeps the last logits (pipe_buffers) and loss; their autograd graph holds DeepSpeed's
    # backward hooks, which hold the engine: a cycle through C++ that gc cannot see, so every engine
    # (weights, optimizer state) would stay in memory until the process ends.
    clear_pipe_buffers(engine)


def check_device(device: str, engine: bool) -> None:
    """`device` is the CPU or a CUDA GPU this machine has; with `engine`, also the device DeepSpeed's
    engine will run on (its accelerator's, chosen when deepspeed is imported)."""
    try:
        kind = torch.device(device)
    except RuntimeError:
        kind = None
    if kind is None or kind.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: not a device here; choose cpu, cuda or cuda:N")
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {device}: torch sees no CUDA GPU on this machine; run on one or use --device cpu"
            )
        if (kind.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} GPUs (cuda:0 on)")
    accelerator = get_accelerator().device_name()
    if engine and accelerator != kind.type:
        raise ConfigError(
            f"--device {device}: DeepSpeed's engine would run on its accelerator, {accelerator}; "
            f"set DS_ACCELERATOR={kind.type} to time it there"
        )
