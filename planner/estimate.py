"""What each pipeline stage of a run will hold at its peak, known before a job is queued.

    python scripts/estimate_memory.py --config FILE [--override k=v ...] [--stages S]
        [--data-parallel D] [--sentences N --length L] [--gpu-memory 80GB]

    model states   parameters and gradients (replicated), optimizer state (ZeRO-1: sharded over
                   the data-parallel ranks), bytes per parameter as DeepSpeed allocates them
    activations    what backward needs from every micro-batch in flight on the stage (1F1B keeps
                   min(stages - stage, micro-batches) of them); with activation checkpointing only
                   each checkpointed layer's input, plus one layer recomputed at a time
    transients     the all-reduce's flattened gradients and Adam's temporaries at the step

Activation bytes are not a formula: one layer of each kind runs forward on one sentence under
saved-tensor hooks, which record exactly what autograd keeps (whatever the norm scheme, attention
kernel and precision), and that scales with the sentences of a micro-batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, check_counts, exit_on_config_error
from fathom.common.run_layout import MEMORY_FILE
from fathom.pipeline.config.deepspeed_values import accumulation, gradients_all_reduced, zero_optimization_stage
from fathom.pipeline.config.run_config import RunConfig, build_corpus, load_config, with_vocab
from fathom.pipeline.parts.stage_cuts import stage_bounds
from fathom.pipeline.reports.memory import GiB, MeasuredPeak
from fathom.planner.activation_trace import LayerTrace, precision, trace_layers

GB = 10**9
# A CPU rank allocates this much more once it trains, whatever the model's size (DeepSpeed's engine,
# gloo, autograd's threads): measured 45-140 MiB above the estimate at 6 to 96 layers
# (docs/BENCHMARKS.md). A GPU's allocator counts none of it.
CPU_RUNTIME_BYTES = 128 * 2**20


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of one precision/ZeRO mode of DeepSpeed 0.19 (runtime/engine.py picks the
    optimizer wrapper in _do_optimizer_sanity_check)."""

    weights: int  # the module's parameters
    gradients: int  # param.grad
    replicated: int  # further optimizer state every data-parallel rank holds in full
    sharded: int  # optimizer state ZeRO-1 splits over the data-parallel ranks
    flatten: int  # transient: gradients flattened for the all-reduce across replicas
    step: int  # transient, sharded: temporaries of Adam's update of the flat fp32 partition


STATE_BYTES = {
    # torch AdamW: exp_avg and exp_avg_sq
    ("fp32", 0): StateBytes(4, 4, 8, 0, 4, 0),
    # ZeRO-1: an fp32 master partition + exp_avg + exp_avg_sq; at the step the partition's flat
    # gradients, and Adam's sqrt and division each allocate a partition-sized temporary
    ("fp32", 1): StateBytes(4, 4, 0, 12, 4, 12),
    # ZeRO-1 with bf16 gradients: as fp32 (the flat gradient partition cast to fp32)
    ("bf16", 1): StateBytes(2, 2, 0, 12, 2, 12),
    # (bf16 without ZeRO is refused by the config check: DeepSpeed cannot resume it)
}


@dataclass(frozen=True)
class MicroBatchShape:
    """The largest micro-batch: `sentences` pairs padded to `length` tokens on both sides."""

    sentences: int
    length: int


@dataclass
class StageEstimate:
    stage: int
    start: int  # spec indices [start, stop)
    stop: int
    params: int
    model_states: int  # bytes: parameters, gradients, optimizer state
    activations: int  # bytes held for backward, recomputation included
    transient: int  # bytes allocated only around the optimizer step
    runtime: int  # bytes a process holds whatever the model (CPU_RUNTIME_BYTES on a CPU)

    @property
    def peak(self) -> int:
        """Activations are gone by the step, so the two never add up."""
        return self.runtime + self.model_states + max(self.activations, self.transient)


def state_bytes(cfg: RunConfig) -> StateBytes:
    per_param = STATE_BYTES[precision(cfg), zero_optimization_stage(cfg.deepspeed)]
    params = cfg.deepspeed.get("optimizer", {}).get("params", {})
    if params.get("torch_adam") and params.get("fused"):
        # torch's fused AdamW updates in place: of the step's temporaries only the flat fp32 gradients remain
        return dataclasses.replace(per_param, step=min(per_param.step, 4))
    return per_param


def checkpoint_runs(stage: list[LayerTrace], interval: int) -> Iterator[tuple[int, list[LayerTrace], bool]]:
    """A stage's layers as DeepSpeed runs them: runs of `interval` layers (their first index in the stage,
    the layers, whether checkpointed), checkpointed if every layer of the run can be; interval 0: one run."""
    for at in range(0, len(stage), interval or len(stage)):
        run = stage[at : at + interval] if interval else stage
        yield at, run, bool(interval) and all(layer.checkpointable for layer in run)


def parameter_count(layers: list[LayerTrace]) -> int:
    """The parameters of these layers, a tied module's once."""
    tied = {layer.tied_key: layer.params for layer in layers if layer.tied_key}
    return sum(layer.params for layer in layers if not layer.tied_key) + sum(tied.values())


def estimate_stages(
    cfg: RunConfig,
    traces: tuple[list[LayerTrace], int],
    shape: MicroBatchShape,
    stages: int,
    data_parallel: int = 1,
    device: str = "gpu",
) -> list[StageEstimate]:
    """Every stage's memory when the model is cut into `stages` (as pipeline/parts/stage_cuts.py cuts it)."""
    layers, loss_saved = traces
    per_param = state_bytes(cfg)
    interval = cfg.deepspeed["pipeline"].get("activation_checkpoint_interval", 0)
    micro_batches = accumulation(cfg.deepspeed, data_parallel)
    flatten = per_param.flatten if gradients_all_reduced(data_parallel) else 0
    estimates = []
    for stage, (start, stop) in enumerate(itertools.pairwise(stage_bounds(cfg.model, stages))):
        mine = layers[start:stop]
        inputs = [layers[i - 1] if i else None for i in range(start, stop)]  # each layer's producer
        held, recompute = 0, 0
        for at, chunk, checkpointed in checkpoint_runs(mine, interval):
            if checkpointed:
                held += inputs[at].stream if inputs[at] else 0
                recompute = max(recompute, sum(layer.saved for layer in chunk))
            else:
                held += sum(layer.saved for layer in chunk)
        held += max((producer.riders for producer in inputs if producer), default=0)
        last = stage == stages - 1
        held += loss_saved if last else mine[-1].stream + mine[-1].riders
        in_flight = min(stages - stage, micro_batches)
        params = parameter_count(mine)
        sharded = params / data_parallel
        estimates.append(
            StageEstimate(
                stage=stage,
                start=start,
                stop=stop,
                params=params,
                model_states=int(
                    params * (per_param.weights + per_param.gradients + per_param.replicated)
                    + sharded * per_param.sharded
                ),
                activations=shape.sentences * (in_flight * held + recompute),
                transient=int(max(params * flatten, sharded * per_param.step)),
                runtime=CPU_RUNTIME_BYTES if device == "cpu" else 0,
            )
        )
    return estimates


def smallest_stage_count(
    cfg: RunConfig,
    traces: tuple[list[LayerTrace], int],
    shape: MicroBatchShape,
    memory: int,
    data_parallel: int = 1,
    device: str = "gpu",
) -> int | None:
    """The fewest stages whose every peak fits in `memory` bytes (None: not even one Transformer
    layer per stage). The first stage holds min(stages, micro-batches) micro-batches in flight, so up
    to the micro-batch count more stages can need more memory (without activation checkpointing its
    activations stay those of about every layer): those counts are tried one by one. From there on
    peaks shrink as stages grow, and a doubling search and a bisection suffice."""

    def fits(stages: int) -> bool:
        return max(s.peak for s in estimate_stages(cfg, traces, shape, stages, data_parallel, device)) <= memory

    most = cfg.model.encoder_layers + cfg.model.decoder_layers
    low = min(accumulation(cfg.deepspeed, data_parallel), most)
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


def parse_size(text: str) -> int:
    """'80GB' (10^9), '80GiB' (2^30), '512MB', '512MiB'; a bare number is GB."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(GB|GiB|MB|MiB)?\s*", text, re.IGNORECASE)
    if not match:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size like 80GB or 40GiB")
    units = {"gb": GB, "gib": GiB, "mb": 10**6, "mib": 2**20}
    return int(float(match[1]) * units[(match[2] or "GB").lower()])


def fill_vocab_and_length(cfg: RunConfig, length: int | None) -> int:
    """Fills the vocabulary sizes the config leaves out from the data's dictionaries, and returns
    `length`, else the data's longest pair (with eos); reads the data only if one of them is missing."""
    vocab_missing = cfg.model.src_vocab_size is None or cfg.model.tgt_vocab_size is None
    if length is not None and not vocab_missing:
        return length
    corpus = build_corpus(cfg)
    if vocab_missing:
        cfg.model = with_vocab(cfg.model, corpus)
    return length or int(corpus.lengths().max())


def micro_batch_shape(cfg: RunConfig, sentences: int | None, length: int) -> MicroBatchShape:
    """The worst micro-batch of the run: pairs padded to `length`, as many as the batch size or the
    token budget allows unless given."""
    if sentences is None:
        budget = cfg.data.max_tokens
        sentences = max(1, budget // length) if budget else cfg.deepspeed["train_micro_batch_size_per_gpu"]
    return MicroBatchShape(sentences, length)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument("--config", required=True, help="experiment JSON, as for scripts/train.py")
    parser.add_argument("--override", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--stages", type=int, help="pipeline stages (default: the config's pipeline.stages)")
    parser.add_argument("--data-parallel", type=int, default=1, help="replicas of the pipeline (ZeRO-1 shards)")
    parser.add_argument("--sentences", type=int, help="pairs per micro-batch (default: from the config)")
    parser.add_argument("--length", type=int, help="padded tokens per sentence (default: the data's longest)")
    parser.add_argument("--gpu-memory", help="also find the fewest stages that fit, e.g. 80GB")
    parser.add_argument(
        "--device", choices=("gpu", "cpu"), default="gpu", help="where it runs: cpu adds a rank's fixed overhead"
    )
    parser.add_argument("--measured", help="a finished run's save_dir: print its measured peaks beside the estimate")
    return parser.parse_args(argv)


def _gib(value: float) -> str:
    return f"{value / GiB:8.2f}"


def report(cfg: RunConfig, estimates: list[StageEstimate], shape: MicroBatchShape, data_parallel: int) -> str:
    per_param = state_bytes(cfg)
    lines = [
        f"{precision(cfg)}, ZeRO stage {zero_optimization_stage(cfg.deepspeed)}, "
        f"{len(estimates)} stages x {data_parallel} data-parallel, micro-batch {shape.sentences} x {shape.length} "
        f"tokens, {accumulation(cfg.deepspeed, data_parallel)} per step, activation checkpoint interval "
        f"{cfg.deepspeed['pipeline'].get('activation_checkpoint_interval', 0)}",
        f"{'stage':>5} {'layers':>11} {'params':>13} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8} "
        f"{'step tmp':>8} {'peak GiB':>8}",
    ]
    for e in estimates:
        optimizer = e.model_states - e.params * (per_param.weights + per_param.gradients)
        lines.append(
            f"{e.stage:>5} {f'{e.start}-{e.stop - 1}':>11} {e.params:>13,} {_gib(e.params * per_param.weights)} "
            f"{_gib(e.params * per_param.gradients)} {_gib(optimizer)} {_gib(e.activations)} {_gib(e.transient)} "
            f"{_gib(e.peak)}"
        )
    return "\n".join(lines)


def measured_report(save_dir: Path, estimates: list[StageEstimate]) -> str:
    """Each rank's measured peak (pipeline/reports/memory.py: above its pre-model baseline) beside its stage's
    estimate."""
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
        estimate = estimates[rank.stage].peak
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
        memory = parse_size(args.gpu_memory) if args.gpu_memory else None
        shape = micro_batch_shape(cfg, args.sentences, fill_vocab_and_length(cfg, args.length))
        traces = trace_layers(cfg, shape.length)
        estimates = estimate_stages(cfg, traces, shape, cfg.stages, args.data_parallel, args.device)
        print(report(cfg, estimates, shape, args.data_parallel))
        print(f"largest stage peak: {max(e.peak for e in estimates) / GiB:.2f} GiB")
        if args.measured:
            print(measured_report(Path(args.measured), estimates))
        if memory:
            fewest = smallest_stage_count(cfg, traces, shape, memory, args.data_parallel, args.device)
            if fewest is None:
                print(f"does not fit in {memory / GiB:.2f} GiB even with one Transformer layer per stage")
            else:
                peak = max(e.peak for e in estimate_stages(cfg, traces, shape, fewest, args.data_parallel, args.device))
                print(f"fewest stages that fit in {memory / GiB:.2f} GiB: {fewest} ", end="")
                print(f"(largest stage peak {peak / GiB:.2f} GiB)")
