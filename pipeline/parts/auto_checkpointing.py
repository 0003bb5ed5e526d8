"""pipeline.activation_checkpoint_interval "auto": the least recomputation whose every stage fits the
memory, chosen before launch from the memory model (pipeline/parts/stage_memory.py), the same on every rank.

What the interval does (DeepSpeed's PipelineModule.forward): each stage's layers run in runs of `interval`,
and a run whose every layer is checkpointable (fathom's Transformer layers) is checkpointed: its input is
kept, and backward recomputes the run's forward, holding that one run's activations at a time. So every
checkpointed layer's forward runs twice whatever the interval. What the interval changes is memory (fewer
inputs kept, a longer run recomputed at a time) and which layers escape: a run that includes an embedding
or the output projection is not checkpointed, so its Transformer layers keep their activations and are
not recomputed.

The rule: of the intervals 0 (none) to the longest stage's layer count (one run a stage), those whose
estimated peak fits on every stage, the one that recomputes the least forward work (stage_cuts' per-layer
costs of the checkpointed layers, summed over the stages); among equals the lowest peak, then the smallest
interval. Interval 0 recomputes nothing, so it wins whenever it fits. Not simply the largest interval that
fits: past about sqrt(layers) a longer run holds more at its recomputation than its fewer inputs save, so
peaks do not fall with the interval, and a longer run recomputes no less unless it takes in an
uncheckpointable layer. Not the lowest peak: every interval from 1 on recomputes about as much, and the
memory left over buys nothing.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch

from fathom.common.errors import ConfigError
from fathom.common.sizes import size_text
from fathom.corpus.batches import ParallelCorpus
from fathom.pipeline.config.checkpoint_choice import CheckpointChoice
from fathom.pipeline.config.deepspeed_values import AUTO_INTERVAL, CHECKPOINT_INTERVAL, DEFAULT_PARTITION
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.parts.activation_trace import LayerTrace, trace_layers
from fathom.pipeline.parts.stage_cuts import layer_costs, stage_bounds
from fathom.pipeline.parts.stage_memory import (
    Device,
    MicroBatchShape,
    checkpoint_runs,
    estimate_stages,
    micro_batch_shape,
    parse_size,
)

# The share of the memory "auto" keeps out of the estimate's reach, for what the estimate does not count:
# on a GPU the CUDA context and the caching allocator's slack above the bytes allocated, and the estimate's
# own misses (docs/BENCHMARKS.md: within 6% on most runs measured, one micro-batch of activations short on
# a first stage with checkpointing and long sentences). Not glibc's heap on a CPU with train.cpu_heap=keep,
# which holds freed tensors on top of the estimate by no fixed share (1.22x in BENCHMARKS.md, 1.75x on a
# 12L-12L d 256 run here): there the launch's line says so.
MEMORY_RESERVE = 0.10
KEPT_HEAP = "; train.cpu_heap=keep holds freed tensors beyond this estimate, set return to stay within it"
BUDGET_KEY = "train.memory_budget"
INTERVAL_KEY = f"pipeline.{CHECKPOINT_INTERVAL}"


@dataclass(frozen=True)
class Candidate:
    """One interval's estimate: every stage's peak, and the forward work it recomputes per token."""

    interval: int
    peaks: tuple[int, ...]
    recomputed: int

    @property
    def peak(self) -> int:
        return max(self.peaks)


def recomputed_work(layers: list[LayerTrace], costs: list[int], bounds: list[int], interval: int) -> int:
    """The forward multiply-adds per token that checkpointing every `interval` layers runs a second time."""
    work = 0
    for start, stop in itertools.pairwise(bounds):
        for at, run, checkpointed in checkpoint_runs(layers[start:stop], interval):
            if checkpointed:
                work += sum(costs[start + at : start + at + len(run)])
    return work


def candidates(
    cfg: RunConfig,
    traces: tuple[list[LayerTrace], int],
    shape: MicroBatchShape,
    stages: int,
    data_parallel: int,
    device: Device,
) -> list[Candidate]:
    """Every interval worth trying: 0 to the longest stage's layer count (past it every stage is one run).
    With train.cuda_graphs, which needs checkpointing, from 1."""
    costs, bounds = layer_costs(cfg.model), stage_bounds(cfg.model, stages)
    longest = max(stop - start for start, stop in itertools.pairwise(bounds))
    found = []
    for interval in range(1 if cfg.train.cuda_graphs else 0, longest + 1):
        estimates = estimate_stages(cfg, traces, shape, stages, data_parallel, device, interval, bounds)
        peaks = tuple(estimate.peak for estimate in estimates)
        found.append(Candidate(interval, peaks, recomputed_work(traces[0], costs, bounds, interval)))
    return found


def choose_interval(
    cfg: RunConfig,
    traces: tuple[list[LayerTrace], int],
    shape: MicroBatchShape,
    stages: int,
    data_parallel: int,
    device: Device,
    memory: int,
    source: str,
) -> CheckpointChoice:
    """The rule (above) for `stages` x `data_parallel` ranks of `memory` bytes each (`source`: where that
    came from) on `device`; a ConfigError in one line if no interval fits."""
    usable = int(memory * (1 - MEMORY_RESERVE))
    tried = candidates(cfg, traces, shape, stages, data_parallel, device)
    fitting = [c for c in tried if c.peak <= usable]
    if not fitting:
        lowest = min(tried, key=lambda c: (c.peak, c.interval))
        batch = "data.max_tokens" if cfg.data.max_tokens else "train_micro_batch_size_per_gpu"
        more = f"raise {BUDGET_KEY}" if source == BUDGET_KEY else "use GPUs with more memory"
        raise ConfigError(
            f'{INTERVAL_KEY}: "{AUTO_INTERVAL}" finds no interval that fits: the lowest estimated peak is '
            f"{size_text(lowest.peak)} (interval {lowest.interval}, stage {lowest.peaks.index(lowest.peak)}), over "
            f"the {size_text(usable)} usable ({source} {size_text(memory)} less a {MEMORY_RESERVE:.0%} reserve); "
            f"add pipeline stages (pipeline.stages), lower {batch}, or {more}"
        )
    best = min(fitting, key=lambda c: (c.recomputed, c.peak, c.interval))
    caveat = KEPT_HEAP if device.kind == "cpu" and cfg.train.cpu_heap == "keep" else ""
    return CheckpointChoice(best.interval, best.peaks, memory, MEMORY_RESERVE, source, caveat)


def gpu_memory() -> int | None:
    """The smallest visible GPU's memory (every rank of a node sees the same GPUs, so all choose alike), or
    None on a machine without one."""
    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def memory_to_fit(
    cfg: RunConfig, device_memory: int | None, device_source: str = "the GPU's memory"
) -> tuple[int, str]:
    """train.memory_budget where set, else `device_memory` (the GPU's, or what `device_source` names); bytes
    and where they came from."""
    if cfg.train.memory_budget is not None:
        budget = parse_size(cfg.train.memory_budget, BUDGET_KEY)
        if budget <= 0:
            raise ConfigError(f"{BUDGET_KEY}: {cfg.train.memory_budget!r} is no memory; give a size like 24GB")
        return budget, BUDGET_KEY
    if device_memory is None:
        raise ConfigError(
            f'{INTERVAL_KEY}: "{AUTO_INTERVAL}" fits the checkpointing to the GPU\'s memory, and a CPU has none of '
            f'its own; set {BUDGET_KEY} to the memory each rank may use, e.g. "8GB"'
        )
    return device_memory, device_source


def requested_interval(cfg: RunConfig) -> int | str:
    return cfg.settings.checkpoint_interval


def with_interval(cfg: RunConfig, choice: CheckpointChoice) -> RunConfig:
    """`cfg` whose DeepSpeed pipeline section holds the chosen interval, and which records the choice."""
    return replace(cfg.with_pipeline(**{CHECKPOINT_INTERVAL: choice.interval}), auto_checkpointing=choice)


def launch_shape(cfg: RunConfig, corpus: ParallelCorpus) -> MicroBatchShape:
    """The run's largest micro-batch: its longest pair (with eos) padded to data.pad_to_multiple, as many
    pairs as the micro-batch size or the token budget (which counts unpadded tokens) allows."""
    longest = int(corpus.lengths().max())
    padded = math.ceil(longest / cfg.data.pad_to_multiple) * cfg.data.pad_to_multiple
    return replace(micro_batch_shape(cfg, None, longest), length=padded)


def resolve_checkpointing(cfg: RunConfig, corpus: ParallelCorpus, world_size: int) -> RunConfig:
    """The launch's config with "auto" resolved to an interval (and train.memory_budget without "auto"
    refused); before any process group, on every rank and in scripts/launch.py, which all choose alike."""
    requested = requested_interval(cfg)
    if requested != AUTO_INTERVAL:
        if cfg.train.memory_budget is not None:
            raise ConfigError(
                f'{BUDGET_KEY}: {cfg.train.memory_budget!r} is the memory {INTERVAL_KEY} "{AUTO_INTERVAL}" fits, '
                f'and the interval is {requested}; set it to "{AUTO_INTERVAL}", or remove {BUDGET_KEY}'
            )
        return cfg
    if cfg.partition != DEFAULT_PARTITION:
        raise ConfigError(
            f'{INTERVAL_KEY}: "{AUTO_INTERVAL}" estimates stages as fathom cuts them (pipeline.partition '
            f"{DEFAULT_PARTITION}), not {cfg.partition}; remove pipeline.partition, or give an interval"
        )
    memory, source = memory_to_fit(cfg, gpu_memory())
    shape = launch_shape(cfg, corpus)
    device = Device("gpu" if torch.cuda.is_available() else "cpu")
    traces = trace_layers(cfg, shape.length)
    choice = choose_interval(cfg, traces, shape, cfg.stages, world_size // cfg.stages, device, memory, source)
    return with_interval(cfg, choice)
