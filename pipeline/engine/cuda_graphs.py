"""CUDA graphs for a stage's Transformer layers (train.cuda_graphs): each layer's forward and backward
replayed as one graph launch each instead of a hundred-odd kernel launches.

At depth with a small width a layer's arithmetic is microseconds of GPU time, while eager PyTorch
spends several milliseconds of host time launching its kernels (docs/BENCHMARKS.md): the GPU waits
for the host. A CUDA graph records a layer's kernels once and launches them all with one call. Each
layer is recorded (`record`) the first time it trains on an input shape, then replayed for every
micro-batch of that shape; other shapes are recorded as they come, up to
`max_shapes` per layer, beyond which a layer runs eagerly (data.pad_to_multiple keeps the count small).

What a replay relies on, and how it holds here:
- Inputs are copied into the graph's own input tensors and its outputs are overwritten by the next
  replay. Activation checkpointing makes that safe: the forward pass runs without autograd and keeps
  only each layer's output, which is copied out of the graph; the backward pass recomputes a layer and
  runs its backward before that layer replays again. Without checkpointing several micro-batches'
  saved activations would share one graph's buffers, so cuda_graphs requires it (check_cuda_graphs).
- Dropout: the graph reads the CUDA generator's seed and offset when it is replayed, and fathom reseeds
  that generator before every layer (pipeline/engine/recompute.py), so a replay is meant to draw the masks
  the eager layer draws (tests/test_gpu.py compares the losses); recording runs the layer a few times,
  and the generator's state is put back afterwards.
- Values that change between steps must live in tensors: BranchNorm's alpha_t is moved into one
  (model.norms.BranchScaled.hold_alpha_in_tensor); other schemes' constants are fixed for the run.
- Parameters keep their memory: ZeRO writes its updates into one flat buffer that the parameters view,
  and checkpoint loads copy into them.

Each layer and shape's graphs have a memory pool of their own (at least one 2 MB block of the caching
allocator), on top of what the memory planner counts: by that estimate, not yet measured, 2 GB or more
at 500L-500L.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fathom.common.errors import ConfigError
from fathom.model.layers import TransformerLayer
from fathom.model.norms import BranchScaled
from fathom.pipeline.config.deepspeed_values import AUTO_INTERVAL
from fathom.pipeline.engine.recompute import device_generator

if TYPE_CHECKING:
    from fathom.pipeline.config.run_config import RunConfig

Inputs = tuple[Tensor, ...]
Shape = tuple[tuple[tuple[int, ...], torch.dtype], ...]


WARMUPS = 3  # runs before recording, as make_graphed_callables does: lazy initialization stays out of the graph


@dataclass(frozen=True)
class Recording:
    """A layer's forward and backward recorded for one input shape: the buffers the graphs read and
    write, and the replays."""

    samples: Inputs  # the forward's inputs
    outputs: tuple[Tensor, ...]
    grad_outputs: tuple[Tensor, ...]  # the backward's inputs
    input_grads: tuple[Tensor | None, ...]  # per sample: None where it needs no gradient
    param_grads: tuple[Tensor | None, ...]  # None for a parameter the layer does not use
    forward: Callable[[], None]
    backward: Callable[[], None]


def record(run: Callable[..., tuple[Tensor, ...]], samples: Inputs, params: list[nn.Parameter]) -> Recording:
    """`run(*samples)`'s forward and its backward to the samples that require grad and to `params`, as
    two CUDA graphs in a memory pool of their own."""
    wrt = [t for t in samples if t.requires_grad] + params
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for _ in range(WARMUPS):
            outputs = run(*samples)
            torch.autograd.grad(outputs, wrt, [torch.ones_like(o) for o in outputs], allow_unused=True)
            del outputs  # with it, the leaves' gradient accumulators made on this stream, which recording would reuse
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog's event queries on another thread stay legal while recording.
    with torch.cuda.graph(forward, pool=pool, capture_error_mode="thread_local"):
        outputs = run(*samples)
    grad_outputs = tuple(torch.empty_like(o) for o in outputs)
    with torch.cuda.graph(backward, pool=pool, capture_error_mode="thread_local"):
        grads = iter(torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True))
    input_grads = tuple(next(grads) if t.requires_grad else None for t in samples)
    return Recording(samples, outputs, grad_outputs, input_grads, tuple(grads), forward.replay, backward.replay)


def replayed(recording: Recording, params: list[nn.Parameter]) -> Callable[..., tuple[Tensor, ...]]:
    """The recording as an autograd function of the layer's inputs: copies them into its buffers and
    replays the forward; its backward copies the output gradients in and replays the backward.

    torch.cuda.make_graphed_callables does this too, but its backward hands autograd detached views of
    the graph's gradient buffers, which AccumulateGrad adopts as a parameter's .grad: the next
    micro-batch's replay then overwrites that .grad, and accumulating adds the new gradient to itself.
    Here autograd gets the buffers themselves, which it copies or adds from and never adopts."""

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Tensor) -> tuple[Tensor, ...]:
            for static, given in zip(recording.samples, args, strict=False):
                if static.data_ptr() != given.data_ptr():
                    static.copy_(given)
            recording.forward()
            return tuple(o.detach() for o in recording.outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
            for static, given in zip(recording.grad_outputs, grads, strict=True):
                if static.data_ptr() != given.data_ptr():
                    static.copy_(given)
            recording.backward()
            return (*recording.input_grads, *recording.param_grads)

    return lambda *inputs: Replay.apply(*inputs, *params)


@contextlib.contextmanager
def stand_ins(layer: nn.Module) -> Iterator[tuple[list[nn.Parameter], list[nn.Parameter]]]:
    """(the layer's trainable parameters, new leaves on the same memory that stand in for them while
    recording). DeepSpeed keeps every parameter's gradient accumulator alive, tied to the stream it was
    made on; differentiating to it on the recording stream would make the default stream wait on the
    recording, which CUDA refuses (cudaErrorStreamCaptureImplicit). The stand-ins' accumulators are made
    while recording, and the graphs read and write the parameters' own memory."""
    swapped = [
        (module, name, param)
        for module in layer.modules()
        for name, param in module._parameters.items()
        if param is not None and param.requires_grad
    ]
    for module, name, param in swapped:
        module._parameters[name] = nn.Parameter(param.detach())
    try:
        yield [param for _, _, param in swapped], [module._parameters[name] for module, name, _ in swapped]
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def as_tuple(outputs: Any) -> tuple[Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def recordable(t: Tensor) -> bool:
    return t.is_cuda


def shape_of(inputs: Inputs) -> Shape:
    return tuple((tuple(t.shape), t.dtype) for t in inputs)


class GraphedLayer:
    """A flat Transformer layer's forward (model/parts.py): graphed in training, per input shape;
    eager in evaluation and generation."""

    def __init__(self, layer: nn.Module, max_shapes: int):
        self.layer = layer
        self.eager = layer.forward
        self.max_shapes = max_shapes
        self.graphs: dict[Shape, Callable[[Inputs], Any]] = {}
        self.warned = False

    def __call__(self, inputs: Inputs) -> Any:
        if not self.layer.training or not recordable(inputs[0]):
            return self.eager(inputs)
        shape = shape_of(inputs)
        graphed = self.graphs.get(shape)
        if graphed is None:
            if len(self.graphs) >= self.max_shapes:
                self._warn_eager(shape)
                return self.eager(inputs)
            graphed = self.graphs[shape] = self._capture(inputs)
        return graphed(inputs)

    def _capture(self, inputs: Inputs) -> Callable[[Inputs], Any]:
        generator = device_generator(inputs[0].device)
        state = generator.get_state()
        with torch.no_grad():  # which outputs are inputs passed through, and in what structure
            outputs = self.eager(inputs)
        single = not isinstance(outputs, tuple)
        passed = [next((j for j, t in enumerate(inputs) if out is t), None) for out in as_tuple(outputs)]
        computed = [i for i, j in enumerate(passed) if j is None]

        def run(*inputs: Tensor) -> tuple[Tensor, ...]:
            outputs = as_tuple(self.eager(inputs))
            return tuple(outputs[i] for i in computed)

        # Autograd needs the floating-point inputs to require grad when the layer is recomputed for
        # the backward pass; the graph must be recorded that way whatever this (forward-only) call has.
        samples = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
        with torch.enable_grad(), stand_ins(self.layer) as (params, leaves):
            graphs = replayed(record(run, samples, leaves), params)
        generator.set_state(state)

        def replay(inputs: Inputs) -> Any:
            results = iter(graphs(*inputs))
            # The forward pass keeps outputs past this graph's next replay (the next micro-batch).
            copy = not torch.is_grad_enabled()
            outputs = tuple(
                inputs[j] if j is not None else (next(results).clone() if copy else next(results)) for j in passed
            )
            return outputs[0] if single else outputs

        return replay

    def _warn_eager(self, shape: Shape) -> None:
        if not self.warned:
            print(
                f"fathom: warning: train.cuda_graphs: a layer has graphs for {self.max_shapes} input shapes; "
                f"{[s for s, _ in shape]} and later new shapes run eagerly (slower); data.pad_to_multiple "
                "makes fewer shapes",
                file=sys.stderr,
                flush=True,
            )
            self.warned = True


def check_cuda_graphs(cfg: RunConfig) -> None:
    """train.cuda_graphs' needs, before launch."""
    if not cfg.train.cuda_graphs:
        return
    if not torch.cuda.is_available():
        raise ConfigError("train.cuda_graphs: CUDA graphs need a CUDA GPU, and torch sees none here; set it false")
    if cfg.train.compile:
        raise ConfigError("train.cuda_graphs: records the eager layers, not compiled ones; set train.compile false")
    interval = cfg.settings.checkpoint_interval
    if interval != AUTO_INTERVAL and interval < 1:  # "auto" chooses from 1 with the graphs
        raise ConfigError(
            "train.cuda_graphs: needs activation checkpointing (a layer's graph holds one micro-batch's "
            "activations at a time); set pipeline.activation_checkpoint_interval, e.g. 1"
        )


def graph_layers(module: nn.Module, max_shapes: int = 8) -> int:
    """Replays every Transformer layer inside `module` from CUDA graphs in training (see the module's
    docstring), in place; returns how many. Parameter names and state dicts do not change."""
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.forward = GraphedLayer(layer, max_shapes)
        device = next(layer.parameters()).device
        for residual in layer.modules():
            if isinstance(residual, BranchScaled):
                residual.hold_alpha_in_tensor(device)
    return len(layers)
