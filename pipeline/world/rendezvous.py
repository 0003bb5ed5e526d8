"""The ranks meet before anything else, within train.startup_timeout, or the job ends naming who never came.

torch's env:// rendezvous waits for every rank with the process group's own timeout (train.hang_timeout
plus 30 s, half an hour by default) and then says only how many joined. A node that could not start its
rank (no virtualenv there, no checkout, a crash at import) held the others that long. Here global rank 0
serves the rendezvous store, every rank writes its host under its rank, and rank 0 waits for all of them
for startup_timeout seconds: the ranks that never wrote are named, each with what the launcher said of the
node they belong to. The process group is then built on that store, and DeepSpeed's init_distributed
adopts it.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fathom.common.errors import ConfigError

JOINED = "fathom/joined/{rank}"
ALL_JOINED = "fathom/all_joined"
POLL_S = 0.1


def env_launched() -> bool:
    """Whether the launcher set torch's env:// variables (deepspeed, torchrun, srun through fathom): an MPI
    launch leaves them to DeepSpeed's discovery through mpi4py, which brings its own rendezvous."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def names(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def wait_for_all(store: dist.Store, size: int, startup_timeout: float) -> None:
    """Global rank 0: until every rank has written its key, or a ConfigError naming those that did not."""
    deadline = time.monotonic() + startup_timeout
    missing = list(range(size))
    while missing:
        missing = [rank for rank in missing if not store.check([JOINED.format(rank=rank)])]
        if missing and time.monotonic() > deadline:
            node, them = ("their nodes", "them") if len(missing) > 1 else ("its node", "it")
            raise ConfigError(
                f"{names(missing)} of {size} never joined within {startup_timeout:g} s (train.startup_timeout): "
                f"{node} could not start {them} (the launcher's output for that node says why: a missing "
                "virtualenv or checkout, a crash at import) or cannot reach "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            )
        time.sleep(POLL_S if missing else 0)
    store.set(ALL_JOINED, "1")


def wait_for_server(address: str, port: int, startup_timeout: float) -> bool:
    """Whether rank 0's store accepts connections within startup_timeout; probed with plain sockets, as torch's
    client logs each failed try with a C++ stack."""
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, port), timeout=POLL_S * 10).close()
            return True
        except OSError:
            time.sleep(POLL_S * 5)
    return False


def join(backend: str, startup_timeout: float, timeout: timedelta) -> None:
    """Builds the default process group (`backend`, collectives timing out after `timeout`) once every
    rank has come, or fails in one line within `startup_timeout` seconds."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    waiting = timedelta(seconds=startup_timeout)
    # torchrun's agent serves the store itself, each restart of the workers under a prefix of its own
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    serves = rank == 0 and not agent
    if not serves and not wait_for_server(address, port, startup_timeout):
        raise ConfigError(_not_met(rank, address, port, startup_timeout))
    try:
        store = dist.TCPStore(address, port, size, is_master=serves, timeout=waiting, wait_for_workers=False)
        if agent:
            store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        store.set(JOINED.format(rank=rank), socket.gethostname())
        if rank == 0:
            wait_for_all(store, size, startup_timeout)
        else:
            store.wait([ALL_JOINED])
    except dist.DistNetworkError as err:
        if "EADDRINUSE" in str(err):
            raise port_in_use(port) from None
        raise ConfigError(_not_met(rank, address, port, startup_timeout)) from None
    except dist.DistError:  # the store's wait timed out, or rank 0 ended it
        raise ConfigError(_not_met(rank, address, port, startup_timeout)) from None
    store.set_timeout(timeout)  # later groups (pipeline, data parallel) meet through it too
    options = {}
    if backend == "nccl":  # as DeepSpeed's own init binds each rank to its GPU
        options["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **options)


def port_in_use(port: int) -> ConfigError:
    return ConfigError(f"port {port} is in use on this machine (another run?); pass the launcher --master_port N")


def _not_met(rank: int, address: str, port: int, startup_timeout: float) -> str:
    return (
        f"rank {rank}: the job did not meet at {address}:{port} within {startup_timeout:g} s "
        "(train.startup_timeout): rank 0 did not start there, or ended the job (its output says why)"
    )
