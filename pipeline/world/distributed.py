"""A process the launcher started: its rank, world size and processes per machine, its process group,
and how it exits.

The training script needs rank and world before the process group exists (the config check, which
rank reports errors, how many CPU threads each rank takes), when only the launcher's environment knows
them, and each launcher names them differently. Each tuple is searched in order; the first variable
set wins. The process group is gloo on CPUs, nccl on GPUs, with the timeout it is given; CPU ranks on
one machine split its cores. `end_distributed` and `run_launched` are how a launched process exits.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.constants import default_pg_timeout

from fathom.common import ports
from fathom.common.errors import ConfigError
from fathom.common.heap import set_training_heap
from fathom.pipeline.config.run_config import TrainConfig
from fathom.pipeline.world.deepspeed_op import DEFAULT_TIMEOUT, prepare_cpu_op
from fathom.pipeline.world.rendezvous import env_launched, join, port_in_use

# deepspeed and torchrun first (mpirun's ranks get these too once DeepSpeed's MPI discovery ran),
# then Open MPI's mpirun, MPICH and Intel MPI (Hydra), MVAPICH2.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
LOCAL_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)
LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
)
DEFAULT_MASTER_PORT = 29500  # torch.distributed's and DeepSpeed's


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_size: int  # processes of this job on this machine
    local_rank: int = 0  # this process's place among them


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in environ:
            return int(environ[name])
    return None


def launched_world(environ: Mapping[str, str] = os.environ) -> World:
    """Not launched: one process. A launcher that does not say how many of its processes share this
    machine is taken to have put them all here, which at worst leaves CPU cores idle."""
    size, rank = _first(environ, SIZE_VARIABLES) or 1, _first(environ, RANK_VARIABLES) or 0
    local_size = _first(environ, LOCAL_SIZE_VARIABLES) or size
    local_rank = _first(environ, LOCAL_RANK_VARIABLES)
    return World(rank, size, local_size, rank % local_size if local_rank is None else local_rank)


def adopt_standalone_world(environ: MutableMapping[str, str] = os.environ) -> bool:
    """A process no launcher started (`python scripts/train.py`, fathom-train) is a world of one on this
    machine, as fairseq's and torchtitan's train.py run alone: exports its env:// variables, where DeepSpeed
    would look for an MPI world through mpi4py instead. Returns whether it did."""
    if any(name in environ for name in RANK_VARIABLES):
        return False
    environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
    environ.setdefault("MASTER_ADDR", "127.0.0.1")
    environ.setdefault("MASTER_PORT", str(ports.free_port()))
    return True


def cpu_threads(environ: Mapping[str, str] = os.environ) -> int:
    """OMP_NUM_THREADS when set (by the user, or by deepspeed --bind_cores_to_rank), else this machine's
    cores split among the job's processes on it, so CPU ranks do not oversubscribe it."""
    if "OMP_NUM_THREADS" in environ:
        return int(environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // launched_world(environ).local_size)


def master_port(environ: Mapping[str, str] = os.environ) -> int:
    """The rendezvous port. DeepSpeed's MPI discovery overwrites MASTER_PORT with the port it is given,
    so a port exported to an mpirun job (-x MASTER_PORT=P) must be handed to it explicitly."""
    return int(environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))


def check_mpi_discovery(environ: Mapping[str, str] = os.environ) -> None:
    """Started by an MPI launcher (no RANK yet), DeepSpeed discovers the world through mpi4py; without
    it every rank would die on an ImportError traceback."""
    if "RANK" in environ or not any(name in environ for name in RANK_VARIABLES[1:]):
        return
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise ConfigError("started by mpirun, but mpi4py is not installed; pip install -e '.[mpi]'") from None


def end_distributed() -> None:
    """Every rank, after its last collective of a run that ended cleanly: meet, then tear the process
    group down, so that no rank leaves while a peer still needs it. Not for a failing rank: its peers
    may be inside a collective it will never join."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def whole_lines(*streams: object) -> None:
    """Each line printed reaches the file in one write. DeepSpeed's launcher starts ranks with
    `python -u`, whose print writes a line's text and its newline separately, so the launcher's own
    output on the same pipe could land between them: `...continues from global_step3[INFO] Killing
    subprocess` and a line that no reader (or test) finds."""
    for stream in streams:
        if isinstance(stream, io.TextIOWrapper):  # not a notebook's stream, say
            stream.reconfigure(line_buffering=True, write_through=False)


def run_launched(main: Callable[[], int | None]) -> NoReturn:
    """Runs a launched process's main; if it returns, every rank got there, so they meet and end the
    process group (end_distributed). Then ends the process with main's exit status (what it returns, or
    what it passes to sys.exit), skipping the
    interpreter's teardown. DeepSpeed keeps its process groups referenced (pipeline grid, p2p, ZeRO), so
    destroy_process_group cannot free them, and gloo objects freed while the interpreter finalizes can
    abort a run that has finished: "terminate called without an active exception", exit 250, twice in
    CI after a run's last line (the mechanism: pytorch/pytorch#179291). Tracebacks print as usual."""
    whole_lines(sys.stdout, sys.stderr)
    try:
        status = main() or 0
        end_distributed()
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            status = exit_.code or 0
        else:  # sys.exit("message"): Python prints it and exits with 1
            print(exit_.code, file=sys.stderr)
            status = 1
    logging.shutdown()
    # mpirun counts a process that leaves without MPI_Finalize as failed, and mpi4py finalizes only at
    # interpreter exit (present when DeepSpeed's MPI discovery imported it).
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def init_distributed(
    timeout: timedelta = default_pg_timeout,
    cpu_heap: str = TrainConfig.cpu_heap,
    startup_timeout: float = TrainConfig.startup_timeout,
) -> None:
    """nccl on GPUs, gloo on CPUs, once every rank has joined within `startup_timeout` (rendezvous.py);
    CPU ranks on one machine split its cores instead of oversubscribing, with glibc's heap as
    train.cpu_heap says. A collective waits `timeout` before the backend gives up: training passes the
    watchdog's (safety/watchdog.py), which outlasts it; a process without a watchdog keeps DeepSpeed's."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    adopt_standalone_world()
    if backend == "gloo":  # DeepSpeed compiles its CPU all-reduce inside init_distributed: in this environment's
        prepare_cpu_op(min(DEFAULT_TIMEOUT, startup_timeout / 2))  # directory, never on a dead build's lock
    if env_launched() and not dist.is_initialized():  # a process may train several runs (the study's cells)
        join(backend, startup_timeout, timeout)
    try:  # adopts the group join() built; under mpirun, discovers the world and builds it
        deepspeed.init_distributed(dist_backend=backend, distributed_port=master_port(), timeout=timeout)
    except dist.DistNetworkError as err:  # raised on rank 0, which listens on the port
        if "EADDRINUSE" not in str(err):
            raise
        raise port_in_use(master_port()) from None
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
