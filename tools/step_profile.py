"""Where a deep, narrow training step's time goes: DeepSpeed's engine against a plain PyTorch loop of
the same model, per Transformer layer and micro-batch (scripts/bench.py --profile).

At depth with a small width, a layer's arithmetic is a few microseconds of device time; what sets
the step's speed is the host: Python, autograd and the ATen ops and kernel launches it issues per
layer. Both systems run one optimizer step over `micro_batches` micro-batches of the same fixed batch,
with the same dropout, loss and AdamW:

- plain: the single-process Transformer, gradients accumulated over the micro-batches, then AdamW;
  no activation checkpointing and no gradient clipping: what the model itself costs, the baseline;
- plain-checkpointed: the same with every `checkpoint_interval`-th layer under torch's checkpoint
  (reentrant, random states saved and restored): what recomputation costs a plain loop;
- engine: what scripts/train.py runs, at one stage: build_engine (ZeRO-1, gradient clipping at 1.0)
  with every `checkpoint_interval`-th layer's activations recomputed in the backward pass, as training
  does at depth, fathom's dropout reseeding per layer and micro-batch, and its stability guard (a check
  of every layer's output, one of the loss and gradients before the update).

So the engine's step time over the plain loop's is everything training adds to the model: the
pipeline schedule, the recomputed forward, the reseeding, the checks, the clipping and ZeRO's copies. A third
system, engine-deepspeed, is the same engine with DeepSpeed's own settings where fathom picks others
(its checkpoint function, contiguous_gradients, its throughput timer, ZeRO's gradient scans): what those
choices save.

Precision: fp32, or bf16: the plain loop then keeps fp32 weights under torch.autocast to bf16, the
engine trains bf16 as training does (ZeRO-1, fp32 master weights).

Wall time is the median over the timed steps of every round (the systems take turns each round); the
counts come from torch.profiler over one more step of the last round: every aten:: op (nested ones
included), and on a GPU the kernel launches and the kernels' summed device time.

Two more systems are timed where asked for: engine-compiled, the engine with every Transformer layer's
forward compiled by torch.compile (train.compile): fewer, fused kernels per layer, its warmup steps
compile; and on a GPU engine-graphed, every Transformer layer replayed from CUDA graphs
(train.cuda_graphs): one launch per layer and pass, its first step records the graphs.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from fathom.common.errors import ConfigError
from fathom.corpus.batches import DataPosition, MicroBatch
from fathom.model.layers import compile_layers, compiler_missing
from fathom.model.model_config import ModelConfig
from fathom.model.norms import build_scheme
from fathom.model.transformer import Transformer
from fathom.pipeline.config.deepspeed_values import check_deepspeed
from fathom.pipeline.engine.cuda_graphs import graph_layers
from fathom.pipeline.engine.internals import set_checkpoint_function, set_gradient_scans, set_self_reduction
from fathom.pipeline.patches import patch_training
from fathom.tools.in_process_engine import built_engine, check_device
from fathom.tools.timed_steps import (
    Step,
    deepspeed_config,
    plain_loop,
    synchronized,
    synthetic_batch,
    time_steps,
    to_device,
)

# the host's launch calls: a kernel, or a CUDA graph of many
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


@dataclass(frozen=True)
class ProfileBench:
    model: ModelConfig  # encoder_layers = decoder_layers: the depth
    batch: int  # pairs per micro-batch
    src_len: int
    tgt_len: int
    micro_batches: int
    checkpoint_interval: int  # the engine's; 0: no activation checkpointing
    precision: str  # fp32 or bf16 (plain: fp32 weights under autocast)
    device: str
    warmup: int
    steps: int
    rounds: int = 1
    systems: tuple[str, ...] = ()  # of SYSTEMS, plain among them; () all but engine-compiled
    trace: Path | None = None  # a folder: each system's profiled step as a Chrome trace, Python frames included


@dataclass
class StepProfile:
    system: str
    depth: int
    step_s: float  # wall time, median
    aten_ops: int  # in one step
    kernel_launches: int  # in one step (0 on a CPU)
    kernel_s: float  # summed device time of the kernels of one step (0 on a CPU)
    layer_passes: int  # Transformer layers x micro-batches of a step, what the per-layer figures divide by

    def per_layer(self, value: float) -> float:
        """`value` (of one step) per Transformer layer and micro-batch."""
        return value / self.layer_passes


def checkpointed(layer: torch.nn.Module) -> None:
    """`layer` recomputed in the backward pass by torch's checkpoint as a plain loop would use it: reentrant,
    saving and restoring the random states so that dropout draws the same masks again."""
    forward = layer.forward
    layer.forward = lambda *inputs: checkpoint(forward, *inputs, use_reentrant=True)


@contextlib.contextmanager
def plain_step(bench: ProfileBench, batch: MicroBatch, checkpoint_interval: int = 0) -> Iterator[Step]:
    """The model's own cost: fp32 weights (bf16: under autocast), no clipping, every
    `checkpoint_interval`-th layer recomputed (0: none)."""
    model = Transformer(bench.model).to(bench.device).train()
    if checkpoint_interval:
        for stack in (model.encoder.layers, model.decoder.layers):
            for layer in stack[::checkpoint_interval]:
                checkpointed(layer)
    precision = "autocast" if bench.precision == "bf16" else "fp32"
    yield plain_loop(model, model, batch, precision, bench.device, bench.micro_batches)


def profile_config(bench: ProfileBench) -> dict[str, Any]:
    """Training's DeepSpeed config at one stage, as ds_configs/branchnorm_500L.json has it (ZeRO-1,
    clipping at 1.0), with the plain loop's AdamW and no LR schedule."""
    return deepspeed_config(bench.batch, bench.precision == "bf16", bench.micro_batches, zero_stage=1, clipping=1.0,
                            checkpoint_interval=bench.checkpoint_interval)  # fmt: skip


def use_deepspeeds_own(engine: deepspeed.PipelineEngine) -> None:
    """DeepSpeed's own code where build_engine and DropoutMasks install fathom's: its checkpoint function
    (non_reentrant_checkpoint, what pipeline.use_reentrant=false selects), ZeRO's gradient scans and its
    all-reduce on one replica."""
    set_checkpoint_function(engine.module, non_reentrant_checkpoint)
    set_gradient_scans(engine, fused=False)
    set_self_reduction(engine, skipped=False)


@contextlib.contextmanager
def engine_step(
    bench: ProfileBench, batch: MicroBatch, deepspeeds: bool = False, compiled: bool = False, graphed: bool = False
) -> Iterator[Step]:
    """The engine as scripts/train.py runs it, or with DeepSpeed's own settings where fathom picks
    others (docs/TRAINING.md), or with its layers compiled (train.compile) or replayed from CUDA graphs
    (train.cuda_graphs)."""
    with built_engine(bench.model, profile_config(bench), bench.device, deepspeeds) as engine:
        # the dropout masks, the stability guard's per-layer output checks and its check before the update
        masks = patch_training(engine, bench.model, seed=1, position=DataPosition(0, 0, bench.micro_batches, 1)).masks
        if deepspeeds:
            use_deepspeeds_own(engine)
        if compiled:
            compile_layers(engine.module)
        if graphed:
            graph_layers(engine.module)
        micro_batches = itertools.repeat(batch)
        steps = itertools.count()

        def step() -> None:
            masks.start(next(steps))
            engine.train_batch(data_iter=micro_batches)

        yield synchronized(step, bench.device)


# plain-checkpointed: what recomputation costs; engine-deepspeed: what fathom's engine settings save
SYSTEMS: dict[str, Callable[[ProfileBench, MicroBatch], contextlib.AbstractContextManager[Step]]] = {
    "plain": plain_step,
    "plain-checkpointed": lambda bench, batch: plain_step(bench, batch, bench.checkpoint_interval),
    "engine-deepspeed": partial(engine_step, deepspeeds=True),
    "engine": engine_step,
    "engine-compiled": partial(engine_step, compiled=True),
    "engine-graphed": partial(engine_step, graphed=True),
}
DEFAULT_SYSTEMS = ("plain", "plain-checkpointed", "engine-deepspeed", "engine")


def systems_of(bench: ProfileBench) -> tuple[str, ...]:
    return bench.systems or DEFAULT_SYSTEMS


def check(bench: ProfileBench) -> None:
    """Fails before anything is timed on what would fail later: an unknown scheme or device, an engine
    config DeepSpeed or fathom refuses."""
    build_scheme(bench.model)
    check_device(bench.device, engine=True)
    systems = systems_of(bench)
    if unknown := [system for system in systems if system not in SYSTEMS]:
        raise ConfigError(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if "plain" not in systems:
        raise ConfigError("--systems: plain is what the others are measured against; name it too")
    if "engine-compiled" in systems and (missing := compiler_missing()):
        raise ConfigError(f"--systems: engine-compiled: torch.compile cannot build kernels here: {missing}")
    if "engine-graphed" in systems and not bench.device.startswith("cuda"):
        raise ConfigError(f"--systems: engine-graphed: CUDA graphs need --device cuda, not {bench.device}")
    if "engine-graphed" in systems and not bench.checkpoint_interval:
        raise ConfigError("--systems: engine-graphed: needs activation checkpointing (--checkpoint-interval)")
    check_deepspeed(profile_config(bench), bench.model, world_size=1)


def counted(step: Step, device: str, trace: Path | None = None) -> tuple[int, int, float]:
    """(aten ops, kernel launches, kernel seconds) of one call of `step`, from torch.profiler. Kernel
    seconds: everything the GPU ran (copies and memsets too), summed: its busy time if nothing overlaps.
    The profiler's raw events are read, not prof.events(), whose tree of Python objects takes minutes
    to build at depth (22 s for the 320,000 events of a 25L-25L step on a CPU; 0.6 s raw).

    With `trace` (a .json or .json.gz path), the step is also written there as a Chrome trace with the
    Python frames that issued each op (chrome://tracing, ui.perfetto.dev); recording the frames slows
    the host, which the counts do not see."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities, with_stack=trace is not None) as prof:
        step()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    aten = launches = kernel_ns = 0
    for event in prof.profiler.kineto_results.events():
        name = event.name()
        aten += name.startswith("aten::")
        launches += name in KERNEL_LAUNCHES
        if event.device_type() == DeviceType.CUDA:
            kernel_ns += event.duration_ns()
    return aten, launches, kernel_ns / 1e9


def trace_path(bench: ProfileBench, system: str) -> Path | None:
    if bench.trace is None:
        return None
    bench.trace.mkdir(parents=True, exist_ok=True)
    return bench.trace / f"{system}-{bench.model.encoder_layers}L.json.gz"


def profile_systems(bench: ProfileBench) -> list[StepProfile]:
    """Each system's step, built fresh for each round; the systems take turns, so a slow spell of a
    shared machine falls on both."""
    batch = to_device(
        synthetic_batch(bench.model.src_vocab_size, bench.batch, bench.src_len, bench.tgt_len), bench.device
    )
    systems = systems_of(bench)
    times: dict[str, list[float]] = {system: [] for system in systems}
    counts: dict[str, tuple[int, int, float]] = {}
    for last in [False] * (bench.rounds - 1) + [True]:
        for system in systems:
            with SYSTEMS[system](bench, batch) as step:
                times[system] += time_steps(step, bench.warmup, bench.steps)
                print(f"{system}: {statistics.median(times[system]) * 1e3:.1f} ms a step", flush=True)
                if last:  # the counts do not vary; the profiler's step is slow
                    counts[system] = counted(step, bench.device, trace_path(bench, system))
            gc.collect()  # the engine is full of reference cycles: free it before the next system is built
    depth = bench.model.encoder_layers
    passes = (bench.model.encoder_layers + bench.model.decoder_layers) * bench.micro_batches
    return [
        StepProfile(system, depth, statistics.median(times[system]), *counts[system], layer_passes=passes)
        for system in systems
    ]


def at_depth(bench: ProfileBench, depth: int) -> ProfileBench:
    """`bench` with `depth` encoder and `depth` decoder layers."""
    return replace(bench, model=replace(bench.model, encoder_layers=depth, decoder_layers=depth))
