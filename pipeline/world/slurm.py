"""A rank started by Slurm's srun, one task per rank: the world from Slurm's variables.

srun sets no RANK, WORLD_SIZE or MASTER_ADDR: each task has its place in SLURM_PROCID, SLURM_NTASKS and
SLURM_LOCALID, and the step's hosts in SLURM_STEP_NODELIST. So every task of a step exports the variables
torch.distributed's env:// rendezvous (and DeepSpeed, and fathom's own checks) read: the first host of the
step as MASTER_ADDR, a port derived from the job and step ids (the same on every task, different for two
jobs sharing a node) unless MASTER_PORT is set. A launcher inside the step (deepspeed, torchrun, mpirun)
sets RANK or its own variables for its ranks, which then win; the batch script itself (no SLURM_STEP_ID)
is no task of a step.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

from fathom.common import ports
from fathom.common.errors import ConfigError
from fathom.pipeline.world.distributed import RANK_VARIABLES  # a launcher's ranks: Slurm's variables are its task's

RANGE = re.compile(r"(\d+)(?:-(\d+))?")
REPEATED = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def split_top_level(text: str) -> list[str]:
    """`a[1-2,4],b` -> ['a[1-2,4]', 'b']: commas outside brackets separate entries."""
    parts, depth, start = [], 0, 0
    for at, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:at])
            start = at + 1
    parts.append(text[start:])
    return [part for part in parts if part]


def expand_host(pattern: str) -> list[str]:
    """One entry of a Slurm host list, its bracketed ranges expanded with their zero padding:
    `gpu[01-02]-ib` -> ['gpu01-ib', 'gpu02-ib']."""
    opening = pattern.find("[")
    if opening < 0:
        return [pattern]
    closing = pattern.index("]", opening)
    head, body, tail = pattern[:opening], pattern[opening + 1 : closing], pattern[closing + 1 :]
    hosts = []
    for item in body.split(","):
        match = RANGE.fullmatch(item)
        if match is None:
            raise ConfigError(f"SLURM_STEP_NODELIST: cannot read {pattern!r}; set MASTER_ADDR to the first node")
        first, last = match[1], match[2] or match[1]
        for number in range(int(first), int(last) + 1):
            hosts += [f"{head}{number:0{len(first)}d}{rest}" for rest in expand_host(tail)]
    return hosts


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`node[01-03,07],gpu5`) as host names, in its order."""
    return [host for entry in split_top_level(nodelist) for host in expand_host(entry)]


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """SLURM_STEP_TASKS_PER_NODE (`2(x3),1`: 2 tasks on each of 3 nodes, then 1) for node `node`."""
    counts = []
    for item in tasks_per_node.split(","):
        match = REPEATED.fullmatch(item)
        if match is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: cannot read {tasks_per_node!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts[node]


def step_port(job_id: int, step_id: int) -> int:
    """A rendezvous port every task of the step derives alike, below the ephemeral range."""
    low, high = ports.LOWEST, ports.ephemeral_start()
    return low + (job_id * 64 + step_id) % (high - low)


def adopt_slurm_world(environ: MutableMapping[str, str] = os.environ) -> bool:
    """In a task of an srun step that no other launcher started: exports RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_SIZE, MASTER_ADDR and MASTER_PORT from Slurm's variables. Returns whether it did."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    if step is None or "SLURM_PROCID" not in environ or any(name in environ for name in RANK_VARIABLES):
        return False
    node = int(environ.get("SLURM_NODEID", "0"))
    world = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_SIZE": str(tasks_on_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ["SLURM_NTASKS"], node)),
    }
    if "MASTER_ADDR" not in environ:
        world["MASTER_ADDR"] = hostnames(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])[0]
    if "MASTER_PORT" not in environ:
        world["MASTER_PORT"] = str(step_port(int(environ.get("SLURM_JOB_ID", "0")), int(step)))
    environ.update(world)
    return True
