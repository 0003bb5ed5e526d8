"""Per-layer times measured on this machine's device: every distinct pipeline layer of a run, forward and
backward on one micro-batch of the run's shape, in the run's precision. The cluster plan
(planner/cluster_plan.py) turns them into a step time for GPUs of the same kind."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from fathom.model.loss import label_smoothed_cross_entropy
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.parts.activation_trace import each_distinct_layer, sample_tokens
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
    return f"CPU {platform.processor() or platform.machine()}, {threads} thread{'s' if threads > 1 else ''}"


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
        return timed, output

    times, logits = each_distinct_layer(cfg, tokens, measure)
    logits = logits.detach().requires_grad_()
    loss, _ = _forward_backward(lambda: label_smoothed_cross_entropy(logits, tokens, cfg.train.label_smoothing),
                                device, repeats)  # fmt: skip
    last = times[-1]
    return [*times[:-1], LayerTime(last.forward + loss.forward, last.backward + loss.backward)]
