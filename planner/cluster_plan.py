"""A plan for a cluster before anything is queued: how to split its GPUs for a recipe, and what each
split costs.

    python scripts/plan_cluster.py --config RECIPE (--gpus N | --hostfile FILE) --gpu-memory 80GB [--reserve 2GiB]
        [--gpus-per-node 8] [--vocab-size V] [--length L] [--sentences B] [--stages S] [--time-layers]
        [--override k=v ...]

Every split of the GPUs into pipeline stages x data-parallel replicas, with activation checkpointing as
the recipe sets it (for "auto", the interval a launch would choose in --gpu-memory, or train.memory_budget)
and off, is held to four things:

    memory      each stage's peak (planner/estimate.py), --reserve included, against --gpu-memory
    bubble      1F1B idles each stage (S - 1) of every (M + S - 1) forward and backward slots of a step,
                M the micro-batches each replica accumulates
    traffic     bytes sent between stages per step (the outputs forward, token ids included, and their
                gradients back), and the gradients all-reduced among a stage's replicas and among the
                stages that share the embedding
    compute     the slowest stage's work per micro-batch (pipeline/parts/stage_cuts.py's per-layer costs,
                backward twice the forward, a checkpointed layer's forward twice) times the M + S - 1
                slots it waits through: the step's critical path, relative to the best split

The split that fits with the shortest critical path is the plan. A step time in seconds needs per-layer
times measured on the cluster's kind of GPU: --time-layers measures them on this machine's device
(planner/layer_times.py); without them the plan says the step time is unknown.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, check_counts, exit_on_config_error
from fathom.common.sizes import GiB
from fathom.corpus.filters import FilterSettings
from fathom.pipeline.config.deepspeed_values import AUTO_INTERVAL, BATCH_KEYS, check_deepspeed
from fathom.pipeline.config.run_config import DataNotPreparedError, RunConfig, load_config
from fathom.pipeline.parts.activation_trace import LayerTrace, trace_layers
from fathom.pipeline.parts.auto_checkpointing import choose_interval, memory_to_fit, with_interval
from fathom.pipeline.parts.specs import check_partition_layers
from fathom.pipeline.parts.stage_cuts import layer_costs
from fathom.pipeline.parts.stage_memory import (
    GPU,
    Device,
    MicroBatchShape,
    StageEstimate,
    checkpoint_runs,
    estimate_stages,
    micro_batch_shape,
    parameter_count,
    state_bytes,
)
from fathom.planner.cluster import HOSTFILE, Cluster, cluster_of, crossings, launch_command
from fathom.planner.estimate import add_reserve_option, check_length, fill_vocab_and_length, report, reserve_bytes
from fathom.planner.layer_times import LayerTime, device_name, time_layers_here

# DeepSpeed sends the shapes of a micro-batch's tensors ahead of them (fathom's engine has dynamic_shape
# on): one buffer of TENSOR_META_SIZE int32 (deepspeed/runtime/pipe/engine.py).
META_BYTES = 256 * 4
MiB = 2**20


@dataclass(frozen=True)
class Split:
    stages: int
    replicas: int
    checkpoint_interval: int


@dataclass
class SplitPlan:
    split: Split
    cfg: RunConfig  # the run's config with the split's checkpointing
    micro_batches: int  # each replica's, per step
    estimates: list[StageEstimate]
    forward_bytes: list[int]  # per step and replica, over each boundary s -> s + 1: outputs and shapes
    backward_bytes: list[int]  # per step and replica, over each boundary s + 1 -> s: gradients
    replica_reduce: list[int]  # per step: each stage's gradients, all-reduced among its replicas
    tied_reduce: int  # per step and replica: the shared embedding's gradient, all-reduced among its stages
    critical_path: float  # critical_path() in relative_costs' units
    step_seconds: float | None  # critical_path() in per-layer times measured on a device, if there are any

    @property
    def bubble(self) -> float:
        stages = self.split.stages
        return (stages - 1) / (self.micro_batches + stages - 1)

    @property
    def peak(self) -> int:
        return max(estimate.peak for estimate in self.estimates)


def stage_traffic(
    layers: list[LayerTrace], bounds: list[int], sentences: int, micro_batches: int
) -> tuple[list[int], list[int]]:
    """Bytes over each stage boundary per step: forward, what the stage's last layer returns (and the
    shapes ahead of it); backward, a gradient for each of its floats."""
    forward, backward = [], []
    for stop in bounds[1:-1]:
        last = layers[stop - 1]
        forward.append(micro_batches * (sentences * last.sent + META_BYTES))
        backward.append(micro_batches * sentences * (last.stream + last.riders))
    return forward, backward


def tied_reduce_bytes(layers: list[LayerTrace], bounds: list[int], gradient_bytes: int) -> int:
    """The gradient bytes of each tied module that more than one stage holds, all-reduced among them."""
    total = 0
    for key in {layer.tied_key for layer in layers if layer.tied_key}:
        holders = {stage for stage, (start, stop) in enumerate(itertools.pairwise(bounds))
                   if any(layer.tied_key == key for layer in layers[start:stop])}  # fmt: skip
        if len(holders) > 1:
            total += next(layer.params for layer in layers if layer.tied_key == key) * gradient_bytes
    return total


def relative_costs(cfg: RunConfig) -> list[LayerTime]:
    """Per-layer costs that rank splits without a device: stage_cuts' forward multiply-adds per token, the
    backward twice the forward (two products per product)."""
    return [LayerTime(cost, 2 * cost) for cost in layer_costs(cfg.model)]


def critical_path(
    layers: list[LayerTrace], costs: list[LayerTime], bounds: list[int], interval: int, micro_batches: int
) -> float:
    """The slowest stage's forward and backward of one micro-batch (a checkpointed layer's forward twice),
    times the M + S - 1 slots a 1F1B step takes."""
    slowest = 0.0
    for start, stop in itertools.pairwise(bounds):
        work = 0.0
        for at, run, checkpointed in checkpoint_runs(layers[start:stop], interval):
            for cost in costs[start + at : start + at + len(run)]:
                work += cost.forward * (2 if checkpointed else 1) + cost.backward
        slowest = max(slowest, work)
    return slowest * (micro_batches + len(bounds) - 2)


def plan_split(
    cfg: RunConfig,
    traces: tuple[list[LayerTrace], int],
    shape: MicroBatchShape,
    split: Split,
    times: list[LayerTime] | None = None,
    memory: int | None = None,
    device: Device = GPU,
) -> SplitPlan | str:
    """The split's costs (a step time if there are per-layer `times`), or why the config cannot run on it:
    the config check a launch on the split's GPUs would fail. A split whose interval is "auto" gets the one
    a launch would choose on GPUs of `memory` bytes."""
    cfg = cfg.with_pipeline(stages=split.stages, activation_checkpoint_interval=split.checkpoint_interval)
    try:
        check_deepspeed(cfg.deepspeed, cfg.model, world_size=split.stages * split.replicas)
        check_partition_layers(cfg)
        if split.checkpoint_interval == AUTO_INTERVAL:
            fitted, source = memory_to_fit(cfg, memory, "--gpu-memory")
            choice = choose_interval(cfg, traces, shape, split.stages, split.replicas, device, fitted, source)
            cfg = with_interval(cfg, choice)
    except ConfigError as err:
        return str(err)
    interval = cfg.settings.checkpoint_interval
    micro_batches = cfg.settings.accumulation(split.replicas)
    estimates = estimate_stages(cfg, traces, shape, split.stages, split.replicas, device)
    layers = traces[0]
    bounds = [estimate.start for estimate in estimates] + [estimates[-1].stop]
    gradient_bytes = state_bytes(cfg).gradients
    forward, backward = stage_traffic(layers, bounds, shape.sentences, micro_batches)
    return SplitPlan(
        split=split,
        cfg=cfg,
        micro_batches=micro_batches,
        estimates=estimates,
        forward_bytes=forward,
        backward_bytes=backward,
        replica_reduce=[e.params * gradient_bytes if split.replicas > 1 else 0 for e in estimates],
        tied_reduce=tied_reduce_bytes(layers, bounds, gradient_bytes),
        critical_path=critical_path(layers, relative_costs(cfg), bounds, interval, micro_batches),
        step_seconds=critical_path(layers, times, bounds, interval, micro_batches) if times else None,
    )


def splits(cfg: RunConfig, gpus: int) -> list[Split]:
    """Every stages x replicas that uses all the GPUs, each with the config's checkpointing and without."""
    most_stages = cfg.model.encoder_layers + cfg.model.decoder_layers
    interval = cfg.settings.checkpoint_interval
    return [Split(stages, gpus // stages, checkpointing)
            for checkpointing in dict.fromkeys((interval, 0))
            for stages in range(1, min(gpus, most_stages) + 1) if gpus % stages == 0]  # fmt: skip


def _size(value: float) -> str:
    return f"{value / GiB:.2f} GiB" if value >= GiB else f"{value / MiB:.1f} MiB"


def split_table(plans: list[tuple[Split, SplitPlan | str]], cluster: Cluster, best: SplitPlan | None) -> str:
    fastest = min((p.critical_path for _, p in plans if isinstance(p, SplitPlan) and p.peak <= cluster.memory),
                  default=None)  # fmt: skip
    timed = best is not None and best.step_seconds is not None
    lines = [
        f"{'stages x replicas':>17} {'ckpt':>4} {'micro':>5} {'peak GiB':>8} {'fits':>4} {'bubble':>6} "
        f"{'p2p/step':>10} {'all-reduce':>10} {'step s' if timed else 'compute':>7}"
    ]
    for split, plan in plans:
        interval = split.checkpoint_interval
        if isinstance(plan, SplitPlan) and interval == AUTO_INTERVAL:  # as "auto" chose it
            interval = f"{plan.cfg.settings.checkpoint_interval}*"
        head = f"{f'{split.stages} x {split.replicas}':>17} {interval:>4}"
        if isinstance(plan, str):
            lines.append(f"{head}  {plan}")
            continue
        fits = plan.peak <= cluster.memory
        relative = f"{plan.critical_path / fastest:.2f}x" if fits and fastest else "-"
        if timed:
            relative = f"{plan.step_seconds:.2f}" if fits else "-"
        sent = max((f + b for f, b in zip(plan.forward_bytes, plan.backward_bytes, strict=True)), default=0)
        lines.append(
            f"{head} {plan.micro_batches:>5} {plan.peak / GiB:>8.2f} {'yes' if fits else 'no':>4} {plan.bubble:>6.1%} "
            f"{_size(sent):>10} {_size(max(plan.replica_reduce) + plan.tied_reduce):>10} {relative:>7}"
            + ("  <- plan" if plan is best else "")
        )
    lines.append(
        '(ckpt: activation checkpoint interval, * as "auto" chooses it; micro: micro-batches per replica and step; '
        "p2p: bytes over the busiest stage boundary per step, both ways; all-reduce: the largest stage's gradient "
        "bytes per step; "
        + (
            "step s: the step's critical path in per-layer times, without communication)"
            if timed
            else "compute: the step's critical path without communication, relative to the fastest split that fits)"
        )
    )
    return "\n".join(lines)


def plan_details(plan: SplitPlan, shape: MicroBatchShape, cluster: Cluster, launch: str, timed_on: str | None) -> str:
    """The plan stage by stage, and `launch`, the command that trains it (`timed_on`: the device the
    per-layer times were measured on, if any)."""
    split = plan.split
    boundaries, groups = crossings(cluster, split.stages, split.replicas)
    lines = [report(plan.cfg, plan.estimates, shape, split.replicas), ""]
    lines.append(
        f"1F1B bubble: {split.stages - 1} of {plan.micro_batches + split.stages - 1} slots idle on every stage "
        f"({plan.bubble:.1%})"
    )
    for stage, (forward, backward) in enumerate(zip(plan.forward_bytes, plan.backward_bytes, strict=True)):
        where = "across nodes" if boundaries[stage] else "within a node"
        lines.append(
            f"stage {stage} -> {stage + 1}: {_size(forward)} forward, {_size(backward)} back per step and replica "
            f"({where})"
        )
    if split.replicas > 1:
        spanning = sum(groups)
        lines.append(
            f"all-reduced per step among each stage's {split.replicas} replicas: its gradients, up to "
            f"{_size(max(plan.replica_reduce))} ({spanning} of {split.stages} stages' replica groups span nodes)"
        )
    if plan.tied_reduce:
        lines.append(f"all-reduced per step among the stages that share the embedding: {_size(plan.tied_reduce)}")
    if plan.step_seconds is None:
        lines.append(
            "step time: unknown; fathom has no per-layer times of the cluster's GPUs (run this with --time-layers "
            "on one of them), so the plan ranks splits by their critical path in per-layer costs"
        )
    else:
        lines.append(
            f"step time: {plan.step_seconds:.2f} s from per-layer times measured on {timed_on} (the 1F1B critical "
            "path; communication and the optimizer's step not included)"
        )
    lines.append(f"launch: {launch}")
    if cluster.hostfile_unknown:
        lines.append(f"({HOSTFILE}: DeepSpeed's hostfile of the {len(cluster.nodes)} nodes, a 'HOST slots=GPUS' line "
                     "each; plan with --hostfile to have it here)")  # fmt: skip
    return "\n".join(lines)


def choose(plans: list[tuple[Split, SplitPlan | str]], memory: int) -> SplitPlan | None:
    """The split that fits with the shortest critical path; on a tie, the fewer stages."""
    fitting = [plan for _, plan in plans if isinstance(plan, SplitPlan) and plan.peak <= memory]
    return min(fitting, key=lambda plan: (plan.step_seconds or plan.critical_path, plan.split.stages), default=None)


def no_plan_error(plans: list[tuple[Split, SplitPlan | str]], cluster: Cluster) -> ConfigError:
    """Why no split is the plan: none fits the memory, or a launch's config check refuses them (most often
    its batch sizes, which not every replica count divides), which no memory would change."""
    refused = [(split, plan) for split, plan in plans if isinstance(plan, str)]
    fix = "add GPUs, or lower data.max_tokens (or --sentences)"
    if not refused:
        return ConfigError(
            f"no split of {cluster.gpus} GPUs holds this run in {cluster.memory / GiB:.2f} GiB each; {fix}"
        )
    (split, reason), gpus = refused[0], f"{cluster.gpus} GPUs"
    check = "the batch check" if all(plan.startswith(BATCH_KEYS) for _, plan in refused) else "the config check"
    example = f"e.g. {split.stages} x {split.replicas}: {reason}"
    if len(refused) == len(plans):
        return ConfigError(f"{check} refuses every split of {gpus}, as a launch on it would ({example}); change that, "
                           "or plan for another GPU count")  # fmt: skip
    return ConfigError(f"no split of {gpus} runs this: {check} refuses {len(refused)} of the {len(plans)} ({example}), "
                       f"and the others need more than {cluster.memory / GiB:.2f} GiB; {fix}")  # fmt: skip


def chosen_split(
    plans: list[tuple[Split, SplitPlan | str]], stages: int, checkpointing: int, cluster: Cluster
) -> SplitPlan:
    """The user's split (--stages) with the config's checkpointing, or why it cannot run."""
    for split, plan in plans:
        if split.stages == stages and split.checkpoint_interval == checkpointing:
            if isinstance(plan, str):
                raise ConfigError(f"--stages {stages}: {plan}")
            if plan.peak > cluster.memory:
                raise ConfigError(
                    f"--stages {stages}: a stage peaks at {plan.peak / GiB:.2f} GiB, over the GPU's memory"
                )
            return plan
    raise ConfigError(
        f"--stages {stages}: not a divisor of {cluster.gpus} GPUs at most the model's layers; see the table"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument("--config", required=True, help="a recipe's name or an experiment JSON")
    parser.add_argument("--override", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", type=int, help="GPUs in the cluster")
    where.add_argument("--hostfile", help="DeepSpeed's hostfile ('HOST slots=N' lines): its GPUs and nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --gpus: GPUs per node (default 8)")
    parser.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GB or 80GiB")
    add_reserve_option(parser)
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="the dictionary's entries, to plan before the data is prepared (--vocab-size 40000 makes 40008)",
    )
    parser.add_argument("--stages", type=int, help="detail this stage count's split (config's checkpointing) instead")
    parser.add_argument("--sentences", type=int, help="pairs per micro-batch (default: from the config)")
    parser.add_argument(
        "--time-layers",
        action="store_true",
        help="time each distinct layer on this machine's GPU (else CPU) for a step time on devices of its kind",
    )
    parser.add_argument(
        "--length", type=int, help="padded tokens per sentence (default: the data's longest pair, with eos)"
    )
    return parser.parse_args(argv)


def planned_config(
    config: str, overrides: list[str], vocab_size: int | None, length: int | None
) -> tuple[RunConfig, int]:
    """The run's config and its longest padded pair. With `vocab_size` the data is not read: it may not be
    prepared yet, and the length is then prepare_data.py's longest (its --max-len, and eos) unless given,
    or model.max_positions where that is less (a run refuses longer pairs)."""
    if vocab_size is None:
        cfg = load_config(config, overrides, world_size=None)
        try:
            return cfg, fill_vocab_and_length(cfg, length)
        except DataNotPreparedError as err:
            raise ConfigError(f"{err}; or plan without it: --vocab-size V [--length L]") from None
    vocab = [f"model.src_vocab_size={vocab_size}", f"model.tgt_vocab_size={vocab_size}"]
    cfg = load_config(config, [*overrides, *vocab], world_size=None)
    if length is not None:
        return cfg, check_length(cfg, length, given=True)
    return cfg, min(FilterSettings().max_len + 1, cfg.model.max_positions)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        check_counts({"--vocab-size": args.vocab_size, "--sentences": args.sentences, "--length": args.length,
                      "--stages": args.stages})  # fmt: skip
        cluster = cluster_of(args.gpus, args.hostfile, args.gpus_per_node, args.gpu_memory)
        cfg, length = planned_config(args.config, args.override, args.vocab_size, args.length)
        shape = micro_batch_shape(cfg, args.sentences, length)
        traces = trace_layers(cfg, shape.length)
        times = time_layers_here(cfg, traces, shape.sentences, shape.length) if args.time_layers else None
        device = Device("gpu", reserve_bytes(args.reserve))
        plans = [(split, plan_split(cfg, traces, shape, split, times, cluster.memory, device))
                 for split in splits(cfg, cluster.gpus)]  # fmt: skip
        best = choose(plans, cluster.memory)
        model = cfg.model
        print(
            f"{Path(args.config).stem}: {model.encoder_layers}L-{model.decoder_layers}L, "
            f"{parameter_count(traces[0]):,} parameters; {cluster.describe()}; micro-batches of at most "
            f"{shape.sentences} x {shape.length} tokens"
        )
        print(split_table(plans, cluster, best))
        if best is None:
            raise no_plan_error(plans, cluster)
        checkpointing = cfg.settings.checkpoint_interval
        shown = best if args.stages is None else chosen_split(plans, args.stages, checkpointing, cluster)
        print()
        timed_on = device_name() if args.time_layers else None
        interval = shown.split.checkpoint_interval
        planned = launch_command(cluster, args.config, args.override, shown.split.stages, interval, checkpointing)
        print(plan_details(shown, shape, cluster, planned, timed_on))
