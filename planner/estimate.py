"""What each pipeline stage of a run will hold at its peak, known before a job is queued.

    python scripts/estimate_memory.py --config FILE [--override k=v ...] [--stages S]
        [--data-parallel D] [--sentences N --length L] [--gpu-memory 80GB] [--device gpu|cpu] [--reserve SIZE]

Per stage: the fixed part every process holds (--reserve, else stage_memory.FIXED_BYTES for the device),
model states, activations and the step's transients, as pipeline/parts/stage_memory.py models them (its
docstring says what each counts and how activations are traced).

A config's pipeline.activation_checkpoint_interval "auto" is the interval a launch would choose
(pipeline/parts/auto_checkpointing.py) to fit train.memory_budget, else --gpu-memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, check_counts, exit_on_config_error
from fathom.common.run_layout import MEMORY_FILE
from fathom.common.sizes import GiB
from fathom.pipeline.config.deepspeed_values import AUTO_INTERVAL
from fathom.pipeline.config.run_config import RunConfig, load_config
from fathom.pipeline.config.run_data import build_corpus, with_vocab
from fathom.pipeline.parts.activation_trace import LayerTrace, planned_precision, trace_layers
from fathom.pipeline.parts.auto_checkpointing import (
    BUDGET_KEY,
    INTERVAL_KEY,
    choose_interval,
    memory_to_fit,
    requested_interval,
    with_interval,
)
from fathom.pipeline.parts.stage_memory import (
    FIXED_BYTES,
    GPU,
    Device,
    MicroBatchShape,
    StageEstimate,
    estimate_stages,
    micro_batch_shape,
    parse_size,
    state_bytes,
)
from fathom.pipeline.reports.memory import MeasuredPeak


def smallest_stage_count(
    cfg: RunConfig,
    traces: tuple[list[LayerTrace], int],
    shape: MicroBatchShape,
    memory: int,
    data_parallel: int = 1,
    device: Device = GPU,
) -> int | None:
    """The fewest stages whose every peak fits in `memory` bytes (None: not even one Transformer
    layer per stage). The first stage holds min(stages, micro-batches) micro-batches in flight, so up
    to the micro-batch count more stages can need more memory (without activation checkpointing its
    activations stay those of about every layer): those counts are tried one by one. From there on
    peaks shrink as stages grow, and a doubling search and a bisection suffice."""

    def fits(stages: int) -> bool:
        estimates = estimate_stages(cfg, traces, shape, stages, data_parallel, device)
        return max(s.peak for s in estimates) <= memory

    most = cfg.model.encoder_layers + cfg.model.decoder_layers
    low = min(cfg.settings.accumulation(data_parallel), most)
    for stages in range(1, low + 1):
        if fits(stages):
            return stages
    high = low  # low: the most stages known not to fit
    while not fits(high := min(2 * high, most)):
        if high == most:
            return None
        low = high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def check_length(cfg: RunConfig, length: int, given: bool) -> int:
    """`length`, refused past model.max_positions: a run refuses any longer pair (pipeline/launch/checks.py),
    and a learned position table has no row for one. `given`: --length named it, else the data did."""
    most = cfg.model.max_positions
    if length > most and given:
        raise ConfigError(
            f"--length {length}: beyond model.max_positions {most}, the longest pair a run takes; give --length "
            f"{most} or less, or raise model.max_positions"
        )
    if length > most:
        raise ConfigError(
            f"model.max_positions: {most} is below the data's longest pair ({length} tokens), which a run "
            "refuses; raise it, or prepare the data with a smaller --max-len"
        )
    return length


def fill_vocab_and_length(cfg: RunConfig, length: int | None) -> int:
    """Fills the vocabulary sizes the config leaves out from the data's dictionaries, and returns
    `length`, else the data's longest pair (with eos); reads the data only if one of them is missing.
    Either is refused past model.max_positions."""
    vocab_missing = cfg.model.src_vocab_size is None or cfg.model.tgt_vocab_size is None
    if length is not None and not vocab_missing:
        return check_length(cfg, length, given=True)
    corpus = build_corpus(cfg)
    if vocab_missing:
        cfg.model = with_vocab(cfg.model, corpus)
    return check_length(cfg, length or int(corpus.lengths().max()), given=length is not None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument("--config", required=True, help="experiment JSON, as for scripts/train.py")
    parser.add_argument("--override", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--stages", type=int, help="pipeline stages (default: the config's pipeline.stages)")
    parser.add_argument("--data-parallel", type=int, default=1, help="replicas of the pipeline (ZeRO-1 shards)")
    parser.add_argument("--sentences", type=int, help="pairs per micro-batch (default: from the config)")
    parser.add_argument("--length", type=int, help="padded tokens per sentence (default: the data's longest)")
    parser.add_argument("--gpu-memory", help="also find the fewest stages that fit, e.g. 80GB")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="where it runs (default gpu)")
    add_reserve_option(parser)
    parser.add_argument("--measured", help="a finished run's save_dir: print its measured peaks beside the estimate")
    return parser.parse_args(argv)


def add_reserve_option(parser: argparse.ArgumentParser) -> None:
    gpu, cpu = FIXED_BYTES["gpu"] / GiB, FIXED_BYTES["cpu"] / 2**20
    parser.add_argument(
        "--reserve",
        help="memory each process holds whatever the model: the CUDA context, NCCL's buffers, the allocator's "
        f"reserve (default {gpu:g}GiB on a GPU, {cpu:g}MiB on a CPU; docs/CLUSTERS.md)",
    )


def reserve_bytes(text: str | None) -> int | None:
    """--reserve in bytes (None: the device's FIXED_BYTES); none at all is allowed."""
    return None if text is None else parse_size(text, "--reserve", least=0)


def _gib(value: float) -> str:
    return f"{value / GiB:8.2f}"


def report(cfg: RunConfig, estimates: list[StageEstimate], shape: MicroBatchShape, data_parallel: int) -> str:
    per_param = state_bytes(cfg)
    lines = [
        f"{planned_precision(cfg)}, ZeRO stage {cfg.settings.zero_stage}, "
        f"{len(estimates)} stages x {data_parallel} data-parallel, micro-batch {shape.sentences} x {shape.length} "
        f"tokens, {cfg.settings.accumulation(data_parallel)} per step, activation checkpoint interval "
        f"{cfg.settings.checkpoint_interval}",
        f"{'stage':>5} {'layers':>11} {'params':>13} {'fixed':>8} {'weights':>8} {'grads':>8} {'optim':>8} "
        f"{'activ':>8} {'step tmp':>8} {'peak GiB':>8}",
    ]
    for e in estimates:
        optimizer = e.model_states - e.params * (per_param.weights + per_param.gradients)
        lines.append(
            f"{e.stage:>5} {f'{e.start}-{e.stop - 1}':>11} {e.params:>13,} {_gib(e.fixed)} "
            f"{_gib(e.params * per_param.weights)} "
            f"{_gib(e.params * per_param.gradients)} {_gib(optimizer)} {_gib(e.activations)} {_gib(e.transient)} "
            f"{_gib(e.peak)}"
        )
    return "\n".join(lines)


def measured_report(save_dir: Path, estimates: list[StageEstimate], device: str) -> str:
    """Each rank's measured peak (pipeline/reports/memory.py: above its pre-model baseline) beside its stage's
    estimate: on a GPU what torch allocated, without the fixed part (the CUDA context and NCCL's buffers are
    outside its allocator); on a CPU the resident set, which holds it."""
    path = save_dir / MEMORY_FILE
    if not path.exists():
        raise ConfigError(f"--measured: {path} does not exist; it is written when a training run finishes")
    lines = []
    try:
        peaks = [MeasuredPeak(**entry) for entry in json.loads(path.read_text())]
    except (ValueError, TypeError) as err:
        raise ConfigError(f"--measured: {path} is not a run's memory record ({err}); train the run again") from None
    if not peaks:
        raise ConfigError(f"--measured: {path} holds no ranks; train the run again")
    if (stages := 1 + max(rank.stage for rank in peaks)) != len(estimates):
        raise ConfigError(f"--measured: the run in {save_dir} had {stages} stages; estimate with --stages {stages}")
    for rank in peaks:
        stage = estimates[rank.stage]
        estimate = stage.peak if device == "cpu" else stage.allocated
        lines.append(
            f"rank {rank.rank} (stage {rank.stage}): measured {rank.model_bytes / GiB:.3f} GiB, "
            f"estimated {estimate / GiB:.3f} GiB ({estimate / rank.model_bytes - 1:+.1%})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        check_counts({"--stages": args.stages, "--data-parallel": args.data_parallel, "--sentences": args.sentences,
                      "--length": args.length})  # fmt: skip
        overrides = [*args.override, *([f"pipeline.stages={args.stages}"] if args.stages is not None else [])]
        cfg = load_config(args.config, overrides, world_size=None)
        memory = parse_size(args.gpu_memory) if args.gpu_memory is not None else None
        device = Device(args.device, reserve_bytes(args.reserve))
        shape = micro_batch_shape(cfg, args.sentences, fill_vocab_and_length(cfg, args.length))
        traces = trace_layers(cfg, shape.length)
        if requested_interval(cfg) == AUTO_INTERVAL:
            if memory is None and cfg.train.memory_budget is None:
                raise ConfigError(f'{INTERVAL_KEY}: "{AUTO_INTERVAL}" fits a memory; give --gpu-memory, or set '
                                  f"{BUDGET_KEY}")  # fmt: skip
            fitted, source = memory_to_fit(cfg, memory, "--gpu-memory")
            choice = choose_interval(cfg, traces, shape, cfg.stages, args.data_parallel, device, fitted, source)
            print(choice.line())
            cfg = with_interval(cfg, choice)
        estimates = estimate_stages(cfg, traces, shape, cfg.stages, args.data_parallel, device)
        print(report(cfg, estimates, shape, args.data_parallel))
        print(f"largest stage peak: {max(e.peak for e in estimates) / GiB:.2f} GiB")
        if args.measured:
            print(measured_report(Path(args.measured), estimates, args.device))
        if memory:
            fewest = smallest_stage_count(cfg, traces, shape, memory, args.data_parallel, device)
            if fewest is None:
                print(f"does not fit in {memory / GiB:.2f} GiB even with one Transformer layer per stage")
            else:
                most = estimate_stages(cfg, traces, shape, fewest, args.data_parallel, device)
                peak = max(e.peak for e in most)
                print(f"fewest stages that fit in {memory / GiB:.2f} GiB: {fewest} ", end="")
                print(f"(largest stage peak {peak / GiB:.2f} GiB)")
