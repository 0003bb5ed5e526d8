"""A launched rank's process group: the backend, its timeout, CPU threads, and DeepSpeed's shared memory."""

from __future__ import annotations

import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from common.errors import ConfigError
from common.heap import set_training_heap
from pipeline.config import TrainConfig
from pipeline.watchdog import backend_timeout
from pipeline.world import cpu_threads, master_port


def init_distributed(hang_timeout: float = TrainConfig.hang_timeout, cpu_heap: str = TrainConfig.cpu_heap) -> None:
    """nccl on GPUs, gloo on CPUs; CPU ranks on one machine split its cores instead of oversubscribing,
    with glibc's heap as train.cpu_heap says."""
    try:
        deepspeed.init_distributed(
            dist_backend="nccl" if torch.cuda.is_available() else "gloo",
            distributed_port=master_port(),
            timeout=backend_timeout(hang_timeout),
        )
    except dist.DistNetworkError as err:  # raised on rank 0, which listens on the port
        if "EADDRINUSE" not in str(err):
            raise
        raise ConfigError(
            f"port {master_port()} is in use on this machine (another run?); pass the launcher --master_port N"
        ) from None
    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads())
        release_shm_buffer()
        set_training_heap(cpu_heap)


def shm_buffer() -> Path:
    """The /dev/shm segment DeepSpeed's CPU all-reduce creates for this rank (ops/csrc/cpu/comm/shm.cpp)
    when all ranks are on one machine."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"


def release_shm_buffer() -> None:
    """DeepSpeed never removes its 66 MB per-rank segment, so every CPU run would keep that much RAM
    per rank until reboot. Each rank maps every peer's segment inside init_distributed, so after a
    barrier the names can go: the mappings stay valid until the processes exit, however they exit."""
    dist.barrier()
    shm_buffer().unlink(missing_ok=True)
