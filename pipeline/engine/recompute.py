"""Dropout masks that depend on (seed, micro-batch, layer) only, whatever the run's shape.

A rank's random stream would make a mask depend on which stage holds a layer, which layers came
before it there and which replica reads the micro-batch: a run resumed on another shape (pipeline/
reshape.py) would draw other masks and leave the uninterrupted run's path. Instead every layer of a
stage reseeds dropout's generator as it starts, from the run's seed, the global index of the
micro-batch it runs (corpus.batches.DataPosition, the one MicroBatches reads) and
its own pipeline index. Activation checkpointing recomputes a layer during the backward pass of its
micro-batch, so the backward pass names the micro-batch too: the recomputation draws the same mask.
A reseed costs about 1.5 us a layer and micro-batch (docs/BENCHMARKS.md).

Because the recomputation reseeds itself, checkpointing need not save and restore random states, and
the stage runs torch's reentrant checkpoint without them (`recompute`) instead of DeepSpeed's: its
forward runs without recording autograd and its backward replays the layers once, where DeepSpeed's
non-reentrant checkpoint records the forward for autograd and unpacks every saved tensor through a
Python hook. With fathom's other engine settings (pipeline/config/engine_defaults.py) it
took a 25L-25L d 16 step on a CPU from 2.5-3.0x to 1.8-1.9x a plain loop's without checkpointing, about
what the plain loop with torch's checkpoint took (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import deepspeed
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fathom.corpus.batches import DataPosition
from fathom.pipeline.engine.internals import (
    replace_stage_call,
    set_checkpoint_function,
    stage_layers,
    wrap_instructions,
)


def layer_seed(seed: int, micro_batch: int, layer: int) -> int:
    return ((seed * 1_000_003 + micro_batch) * 100_003 + layer) % (1 << 63)


def recompute(run_layers: Callable[..., Any], *inputs: Any) -> Any:
    """Activation checkpointing for layers that reseed their own dropout (see the module's docstring)."""
    return checkpoint(run_layers, *inputs, use_reentrant=True, preserve_rng_state=False)


def device_generator(device: torch.device) -> torch.Generator:
    """The generator dropout draws from on `device`. torch.manual_seed would seed every device's, and
    queue a traceback for each device type not initialized: 200 us a call instead of 1.5."""
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    return torch.default_generator


class DropoutMasks:
    """Installs the reseeding on an engine's stage; `start(step)` before each train_batch. `position`: which
    micro-batches the launch reads in each step."""

    def __init__(self, engine: deepspeed.PipelineEngine, seed: int, position: DataPosition):
        self.seed = seed
        self.position = position
        self.replica = engine.grid.get_data_parallel_rank()
        self.step = 0
        self.forwards = 0  # forward passes run this step
        self.running = 0  # the micro-batch whose forward or backward runs now
        self.buffers: dict[int, int] = {}  # pipeline buffer -> the micro-batch it holds
        self.generator = device_generator(torch.device(engine.device))
        wrap_instructions(engine, self._track)
        for offset, index, func in list(stage_layers(engine.module)):
            if isinstance(func, nn.Module):
                func.register_forward_pre_hook(lambda module, args, index=index: self._reseed(index))
            else:  # a tied table's later use: a function
                replace_stage_call(engine.module, offset, self._seeded(func, index))
        set_checkpoint_function(engine.module, recompute)

    def start(self, step: int) -> None:
        self.step = step
        self.forwards = 0
        self.buffers.clear()

    def _reseed(self, layer: int) -> None:
        self.generator.manual_seed(layer_seed(self.seed, self.running, layer))

    def _seeded(self, func: Callable[..., Any], layer: int) -> Callable[..., Any]:
        def seeded(*args: Any) -> Any:
            self._reseed(layer)
            return func(*args)

        return seeded

    def _track(self, name: str, method: Callable) -> Callable:
        if name == "ForwardPass":

            def forward(engine: deepspeed.PipelineEngine, buffer_id: int) -> None:
                k, self.forwards = self.forwards, self.forwards + 1
                self.running = self.position.micro_batch(self.step, k, self.replica)
                self.buffers[buffer_id] = self.running
                return method(engine, buffer_id=buffer_id)

            return forward
        if name == "BackwardPass":

            def backward(engine: deepspeed.PipelineEngine, buffer_id: int) -> None:
                self.running = self.buffers[buffer_id]
                return method(engine, buffer_id=buffer_id)

            return backward
        return method
