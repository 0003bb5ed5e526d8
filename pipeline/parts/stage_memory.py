"""What each pipeline stage will hold at its peak, before anything runs: the memory model that the memory
planner (planner/estimate.py, planner/cluster_plan.py) prints and activation checkpointing "auto"
(pipeline/parts/auto_checkpointing.py) chooses by.

    model states   parameters and gradients (replicated), optimizer state (ZeRO-1: sharded over
                   the data-parallel ranks), bytes per parameter as DeepSpeed allocates them
    activations    what backward needs from every micro-batch in flight on the stage (1F1B keeps
                   min(stages - stage, micro-batches) of them); with activation checkpointing only
                   each checkpointed run's input, plus one run recomputed at a time
    transients     the all-reduce's flattened gradients and Adam's temporaries at the step

Activation bytes are not a formula: one layer of each kind runs forward on one sentence under
saved-tensor hooks (pipeline/parts/activation_trace.py), which record exactly what autograd keeps
(whatever the norm scheme, attention kernel and precision), and that scales with the sentences of a
micro-batch. How close it comes to measured peaks: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from fathom.common.errors import ConfigError
from fathom.common.sizes import GiB
from fathom.pipeline.config.deepspeed_values import gradients_all_reduced
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.parts.activation_trace import LayerTrace, planned_precision
from fathom.pipeline.parts.stage_cuts import stage_bounds

GB = 10**9
# What a process holds whatever the model, beside the estimate (the planners' --reserve replaces it):
# - a CPU rank: DeepSpeed's engine, gloo's buffers, autograd's threads and the allocator's slack, measured as
#   its resident set above the estimate with train.cpu_heap=return: 24-66 MiB from 2L-2L d 64 to 48L-48L
#   (docs/BENCHMARKS.md, tests/test_planner.py holds it to that);
# - a GPU: the CUDA context, NCCL's buffers (per communicator: the pipeline's pairs, the replicas' all-reduce)
#   and the caching allocator's reserve beyond what it hands out. An allowance, not measured here (no GPU):
#   the CUDA context alone takes about 0.5 GiB on current GPUs.
FIXED_BYTES = {"cpu": 48 * 2**20, "gpu": 2 * GiB}


@dataclass(frozen=True)
class Device:
    """What every process of a plan runs on: a GPU or a CPU, holding `reserve` bytes whatever the model (the
    planners' --reserve), else its kind's FIXED_BYTES."""

    kind: str = "gpu"
    reserve: int | None = None

    @property
    def fixed(self) -> int:
        return FIXED_BYTES[self.kind] if self.reserve is None else self.reserve


GPU = Device("gpu")


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
    fixed: int  # bytes the process holds whatever the model (FIXED_BYTES)

    @property
    def allocated(self) -> int:
        """What the model's tensors take at the peak: activations are gone by the step, so the two never add up."""
        return self.model_states + max(self.activations, self.transient)

    @property
    def peak(self) -> int:
        return self.fixed + self.allocated


def state_bytes(cfg: RunConfig) -> StateBytes:
    per_param = STATE_BYTES[planned_precision(cfg), cfg.settings.zero_stage]
    optimizer = cfg.settings.optimizer
    params = {} if optimizer is None else optimizer.params
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
    device: Device = GPU,
    interval: int | None = None,
    bounds: list[int] | None = None,
) -> list[StageEstimate]:
    """Every stage's memory when the model is cut into `stages` (as pipeline/parts/stage_cuts.py cuts it),
    checkpointing every `interval` layers (None: the config's interval, which must be a number by then), each
    process on `device`, holding its fixed bytes whatever the model. `bounds`: the cut,
    stage_bounds(cfg.model, stages), from a caller that estimates one cut at many intervals."""
    layers, loss_saved = traces
    per_param = state_bytes(cfg)
    if interval is None:
        interval = cfg.settings.checkpoint_interval
    micro_batches = cfg.settings.accumulation(data_parallel)
    flatten = per_param.flatten if gradients_all_reduced(data_parallel) else 0
    estimates = []
    bounds = stage_bounds(cfg.model, stages) if bounds is None else bounds
    for stage, (start, stop) in enumerate(itertools.pairwise(bounds)):
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
                fixed=device.fixed,
            )
        )
    return estimates


def micro_batch_shape(cfg: RunConfig, sentences: int | None, length: int) -> MicroBatchShape:
    """The worst micro-batch of the run: pairs padded to `length`, as many as the batch size or the
    token budget allows unless given."""
    if sentences is None:
        budget = cfg.data.max_tokens
        sentences = max(1, budget // length) if budget else cfg.settings.micro_batch_size
    return MicroBatchShape(sentences, length)


def parse_size(text: str, name: str = "--gpu-memory", least: int = 1) -> int:
    """'80GB' (10^9), '80GiB' (2^30), '512MB', '512MiB'; a bare number is GB. At least `least` bytes: a GPU
    or budget of no memory fits nothing, and would only fail later as "nothing fits". `name`: the flag or key
    that gave it, for the error."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(GB|GiB|MB|MiB)?\s*", text, re.IGNORECASE)
    if not match:
        raise ConfigError(f"{name} {text!r}: expected a size like 80GB or 40GiB")
    units = {"gb": GB, "gib": GiB, "mb": 10**6, "mib": 2**20}
    size = float(match[1]) * units[(match[2] or "GB").lower()]
    if not math.isfinite(size):  # hundreds of digits: float() gives inf, which int() cannot take
        raise ConfigError(f"{name} {text!r}: not a size any machine has; give one like 80GB or 40GiB")
    if int(size) < least:
        raise ConfigError(f"{name}: {text!r} is no memory, in which nothing fits; give a size like 80GB or 40GiB")
    return int(size)
