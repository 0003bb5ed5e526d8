"""Per-layer times measured on this machine's device: every distinct pipeline layer of a run, forward and
backward on one micro-batch of the run's shape, in the run's precision. The cluster plan
(planner/cluster_plan.py) turns them into a step time for GPUs of the same kind."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from fathom.common.errors import ConfigError
from fathom.common.machine import available_memory, cpu_name
from fathom.common.sizes import GiB
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.parts.activation_trace import LayerTrace, each_distinct_layer, sample_tokens
from fathom.pipeline.parts.stage_modules import PipePart


@dataclass(frozen=True)
class LayerTime:
    forward: float  # seconds, one micro-batch
    backward: float


def device_name() -> str:
    """What the times were measured on, for the plan to say."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    threads = torch.get_num_threads()
    return f"CPU {cpu_name()}, {threads} thread{'s' if threads > 1 else ''}"


def _timed(run: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """run()'s seconds, the device's queued work included, and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def _floats(value: object) -> list[Tensor]:
    values = value if isinstance(value, tuple) else (value,)
    return [v for v in values if isinstance(v, Tensor) and v.is_floating_point()]


def _forward_backward(run: Callable[[], object], device: torch.device, repeats: int) -> tuple[LayerTime, object]:
    """The median seconds of run()'s forward and of its backward (a gradient of ones into every float it
    returns) over `repeats` runs after one to warm up, and its output."""
    forwards, backwards = [], []
    for _ in range(repeats + 1):
        seconds, output = _timed(run, device)
        forwards.append(seconds)
        floats = _floats(output)
        backwards.append(
            _timed(partial(torch.autograd.backward, floats, [torch.ones_like(f) for f in floats]), device)[0]
        )
    return LayerTime(statistics.median(forwards[1:]), statistics.median(backwards[1:])), output


def time_layers(cfg: RunConfig, sentences: int, length: int, repeats: int = 3) -> list[LayerTime]:
    """Forward and backward seconds of every spec on a micro-batch of `sentences` x `length` tokens. The
    output layer's include the loss's."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = sample_tokens(cfg, (sentences, length), device)

    def measure(part: PipePart, module: nn.Module, value: object) -> tuple[LayerTime, object]:
        # inputs as a stage receives them: floats that want gradients, token ids that do not
        values = value if isinstance(value, tuple) else (value,)
        inputs = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in values)
        timed, output = _forward_backward(lambda: part.run(module, inputs if isinstance(value, tuple) else inputs[0]),
                                          device, repeats)  # fmt: skip
        module.zero_grad(set_to_none=True)
        # a large micro-batch on a CPU takes minutes a layer: each one timed is a line, as it comes
        print(f"fathom: --time-layers: {part.name}: forward {timed.forward:.3g} s, backward {timed.backward:.3g} s",
              file=sys.stderr, flush=True)  # fmt: skip
        return timed, output

    print(f"fathom: --time-layers: timing each distinct layer on {device_name()}, {repeats + 1} runs of a micro-batch "
          f"of {sentences} x {length} tokens each", file=sys.stderr, flush=True)  # fmt: skip

    times, logits = each_distinct_layer(cfg, tokens, measure)
    logits = logits.detach().requires_grad_()
    loss, _ = _forward_backward(lambda: label_smoothed_cross_entropy(logits, tokens, cfg.train.label_smoothing),
                                device, repeats)  # fmt: skip
    last = times[-1]
    return [*times[:-1], LayerTime(last.forward + loss.forward, last.backward + loss.backward)]


def _free_memory(device: torch.device) -> int | None:
    """Bytes the timing may still allocate on `device`, None where that cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


def _out_of_memory(err: BaseException) -> bool:
    # a CUDA allocator's failure is torch.OutOfMemoryError; the CPU's, a RuntimeError of this wording
    return isinstance(err, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(err)


def time_layers_here(
    cfg: RunConfig, traces: tuple[list[LayerTrace], int], sentences: int, length: int
) -> list[LayerTime]:
    """time_layers(), or one line where the micro-batch does not fit this machine's device: refused before
    timing where even one layer's activations for backward (the memory planner's traces, times the
    sentences) exceed the free memory, since on a CPU the kernel may kill this process (or another's) for
    it rather than fail an allocation; else when an allocation fails."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers, loss_saved = traces
    least = sentences * max(loss_saved, *(layer.saved for layer in layers))
    free = _free_memory(device)
    memory = f"this machine's {'GPU' if device.type == 'cuda' else 'CPU'} memory"
    shape = f"--time-layers: a micro-batch of {sentences} x {length} tokens"
    fix = (
        "time a smaller micro-batch (lower --sentences or --length), or run --time-layers on one of the cluster's GPUs"
    )
    if free is not None and least > free:
        raise ConfigError(
            f"{shape} needs at least {least / GiB:.2f} GiB for one layer's backward, over the {free / GiB:.2f} GiB "
            f"free in {memory}; {fix}"
        )
    try:
        return time_layers(cfg, sentences, length)
    except (RuntimeError, MemoryError) as err:
        if not _out_of_memory(err):
            raise
        free_before = f" ({free / GiB:.2f} GiB were free)" if free is not None else ""
        raise ConfigError(f"{shape} does not fit in {memory}{free_before}; {fix}") from None
