"""The cluster a plan is for: its GPUs, how they sit on nodes, and where DeepSpeed puts a run's ranks on them."""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass

from fathom.common.errors import check_counts
from fathom.common.sizes import GiB
from fathom.pipeline.launch.command import read_hostfile
from fathom.pipeline.parts.stage_memory import parse_size


@dataclass(frozen=True)
class Cluster:
    gpus: int
    nodes: list[int]  # GPUs per node, in rank order
    memory: int  # bytes per GPU
    hostfile: str | None = None  # DeepSpeed's hostfile it was read from

    @property
    def hostfile_unknown(self) -> bool:
        """Nodes counted by --gpus: a launch on them needs a hostfile this cluster has no path for."""
        return self.hostfile is None and len(self.nodes) > 1

    def node_of(self, rank: int) -> int:
        return next(node for node, end in enumerate(itertools.accumulate(self.nodes)) if rank < end)

    def describe(self) -> str:
        count = f"{len(self.nodes)} node{'s' if len(self.nodes) > 1 else ''}"
        shape = (
            f"{count} of {self.nodes[0]}"
            if len(set(self.nodes)) == 1
            else f"{count} of {', '.join(map(str, self.nodes))}"
        )
        return f"{self.gpus} GPUs ({shape}), {self.memory / GiB:.2f} GiB each"


def crossings(cluster: Cluster, stages: int, replicas: int) -> tuple[list[bool], list[bool]]:
    """Which stage boundaries and which stages' replica groups span nodes. DeepSpeed ranks a pipe x data
    grid with the replicas adjacent: stage s, replica d is rank s x replicas + d."""

    def node(stage: int, replica: int) -> int:
        return cluster.node_of(stage * replicas + replica)

    boundaries = [any(node(s, d) != node(s + 1, d) for d in range(replicas)) for s in range(stages - 1)]
    groups = [len({node(s, d) for d in range(replicas)}) > 1 for s in range(stages)]
    return boundaries, groups


def cluster_of(gpus: int | None, hostfile: str | None, gpus_per_node: int, memory: str) -> Cluster:
    """The cluster of a hostfile (its slots), else of `gpus` on nodes of `gpus_per_node`."""
    if hostfile:
        nodes = list(read_hostfile(hostfile).values())
        return Cluster(sum(nodes), nodes, parse_size(memory), hostfile)
    check_counts({"--gpus": gpus, "--gpus-per-node": gpus_per_node})
    full, left = divmod(gpus, gpus_per_node)
    return Cluster(gpus, [gpus_per_node] * full + ([left] if left else []), parse_size(memory))


# what the plan sets, in place of any value the user's overrides gave them
PLANNED_KEYS = ("pipeline.stages", "pipeline.activation_checkpoint_interval")
# the place of a hostfile a plan for nodes counted by --gpus does not know
HOSTFILE = "HOSTFILE"


def launch_command(
    cluster: Cluster, config: str, overrides: list[str], stages: int, interval: int | str, configured: int | str
) -> str:
    """The command that trains `stages` checkpointing every `interval` layers (`configured`: the config's
    interval) on `cluster`: fathom-launch (DeepSpeed's launcher arguments, checked) running the installed
    module (a wheel has no scripts/), with the config and every override the plan was made with, the plan's
    own (PLANNED_KEYS) last and alone, and --resume (a job started again goes on from its last checkpoint).
    One node counted by --gpus is --num_gpus; several need a hostfile, which only --hostfile names: HOSTFILE
    stands for it."""
    planned = [f"pipeline.stages={stages}"]
    if interval != configured:
        planned.append(f"pipeline.activation_checkpoint_interval={interval}")
    if cluster.hostfile_unknown:
        where = ["--hostfile", HOSTFILE]
    elif cluster.hostfile:
        where = ["--hostfile", cluster.hostfile]
    else:
        where = ["--num_gpus", str(cluster.gpus)]
    kept = [override for override in overrides if override.partition("=")[0].strip() not in PLANNED_KEYS]
    return shlex.join(["fathom-launch", *where, "--module", "fathom.train", "--config", config, "--override", *kept,
                       *planned, "--resume"])  # fmt: skip
