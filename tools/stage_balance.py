"""How evenly pipeline/parts/stage_cuts.py's cut loads the stages, measured: each stage's forward and backward
timed alone in one process on the activations the stages before it produce (scripts/bench.py
--stage-times). The slowest stage sets the pace of every micro-batch."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from fathom.corpus.batches import MicroBatch
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import ModelConfig
from fathom.model.parts import build_parts
from fathom.pipeline.parts.stage_cuts import stage_bounds
from fathom.pipeline.parts.stage_modules import pipe_parts
from fathom.tools.timed_steps import time_steps


@dataclass
class StageTime:
    stage: int
    start: int  # spec indices [start, stop)
    stop: int
    params: int
    step_s: float  # median forward + backward of the stage's layers on one micro-batch


def built_layers(cfg: ModelConfig) -> list[tuple[nn.Module, Callable[[Any], Any]]]:
    """Every part built once in this process in its pipeline form (tied parts share their module),
    with the callable the engine runs."""
    parts = pipe_parts(cfg)
    modules = build_parts(parts)
    return [(module, partial(part.run, module)) for part, module in zip(parts, modules, strict=True)]


def stage_times(cfg: ModelConfig, stages: int, batch: MicroBatch, warmup: int, steps: int) -> list[StageTime]:
    """Forward + backward time of each stage as pipeline/parts/stage_cuts.py cuts the model, each stage timed
    alone in this process on the activations the stages before it produce: what the pipeline's
    slowest stage costs every micro-batch, without the other stages competing for the cores."""
    modules, layers = zip(*built_layers(cfg), strict=True)
    bounds = stage_bounds(cfg, stages)
    (src_tokens, prev_output_tokens), target = batch
    inputs, value = [], (src_tokens, prev_output_tokens)
    with torch.no_grad():
        for start, stop in itertools.pairwise(bounds):
            inputs.append(value)
            for layer in layers[start:stop]:
                value = layer(value)
    times = []
    for stage, (start, stop) in enumerate(itertools.pairwise(bounds)):
        received = inputs[stage]

        def step(start: int = start, stop: int = stop, received: tuple = received) -> None:
            value = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in received)
            for layer in layers[start:stop]:
                value = layer(value)
            if stop == len(layers):
                label_smoothed_cross_entropy(value, target).backward()
            else:
                sent = [t for t in (value if isinstance(value, tuple) else (value,)) if t.requires_grad]
                torch.autograd.backward(sent, [torch.ones_like(t) for t in sent])

        mine = {id(m): m for m in modules[start:stop]}
        params = sum(p.numel() for m in mine.values() for p in m.parameters())
        seconds = statistics.median(time_steps(step, warmup, steps))
        times.append(StageTime(stage=stage, start=start, stop=stop, params=params, step_s=seconds))
    return times
