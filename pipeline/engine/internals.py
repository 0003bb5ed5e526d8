"""Every use of DeepSpeed's internals (attributes outside its documented API), in this one module.

They were read from DeepSpeed SUPPORTED_VERSION's source and may change in any other release without
notice, so a different installed version is refused at import in one line, before a run can break,
or worse, misbehave quietly, halfway through. tests/test_deepspeed_internals.py exercises each one
on a real engine of the installed DeepSpeed.
"""

from __future__ import annotations

import collections
import contextlib
import math
import sys
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
from deepspeed.runtime.zero.utils import get_norm_dtype
from torch import Tensor, nn

from fathom.pipeline.config.deepspeed_values import gradients_all_reduced

SUPPORTED_VERSION = "0.19.8"


def check_version(installed: str = deepspeed.__version__) -> None:
    if installed.split("+")[0] != SUPPORTED_VERSION:
        print(
            f"fathom: error: DeepSpeed {installed} is installed, but fathom is built and tested against "
            f"{SUPPORTED_VERSION}, whose internals it uses; pip install deepspeed=={SUPPORTED_VERSION}",
            file=sys.stderr,
        )
        sys.exit(2)


check_version()


# PipelineModule: fathom cuts the stages itself (pipeline/parts/stage_cuts.py).
class ExternallyPartitioned(PipelineModule):
    """A PipelineModule whose stage bounds come from `bounds()`, a subclass's, instead of one of
    DeepSpeed's partition methods."""

    def bounds(self) -> list[int]:
        """The first layer of each stage, then the layer count."""
        raise NotImplementedError

    def _partition_layers(self, method: str = "cost") -> None:
        self.parts = self.bounds()
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def stage_layers(pipe: PipelineModule) -> Iterator[tuple[int, int, nn.Module | Callable[..., Any]]]:
    """(offset in this stage, pipeline layer index, what the stage calls for it): a module, or for a
    tied layer's later use, the function DeepSpeed calls instead of its forward."""
    for offset, func in enumerate(pipe.forward_funcs):
        yield offset, int(pipe._local_start) + offset, func  # numpy's int64 after some partition methods


def built_layer(pipe: PipelineModule, index: int, tie: str | None) -> nn.Module:
    """The module of pipeline layer `index` on this stage: PipelineModule registers a layer under the name
    str(index), and a shared table once, as tied_modules[tie]."""
    return pipe.tied_modules[tie] if tie is not None else pipe.get_submodule(str(index))


def stage_range(pipe: PipelineModule) -> range:
    """The pipeline layer indices this rank's stage holds."""
    return range(int(pipe._local_start), int(pipe._local_stop))


def replace_stage_call(pipe: PipelineModule, offset: int, func: Callable[..., Any]) -> None:
    pipe.forward_funcs[offset] = func


def set_checkpoint_function(pipe: PipelineModule, func: Callable[..., Any]) -> None:
    """What activation checkpointing calls as func(run_layers, *inputs). DeepSpeed picks its own when
    the engine starts (pipeline.use_reentrant) and reads the attribute at every forward."""
    pipe.activation_checkpoint_func = func


def built_stage_bounds(pipe: PipelineModule) -> list[int]:
    """The first layer of each stage, then the layer count, as a built pipeline holds them (what
    pipeline/parts/stage_cuts.py's stage_bounds computed from the config)."""
    return [int(bound) for bound in pipe.parts]


# DeepSpeedEngine
def check_for_duplicates(engine: DeepSpeedEngine, optimizer: torch.optim.Optimizer) -> None:
    """DeepSpeed's check that no parameter is in the optimizer's param groups twice, with its message,
    in linear time: DeepSpeed's own rebuilds every group's id list once per parameter, quadratic in the
    parameters (4,203 at 100L-100L: 13 s of building the engine on a CPU)."""
    occurrences = collections.Counter(id(p) for group in optimizer.param_groups for p in group["params"])
    for name, param in engine.module.named_parameters():
        assert occurrences[id(param)] <= 1, (
            f"Parameter with name: {name} occurs multiple times in optimizer.param_groups. Make sure it only "
            "appears once to prevent undefined behavior."
        )


@contextlib.contextmanager
def linear_duplicate_check() -> Iterator[None]:
    """Within the block, engines that deepspeed.initialize builds check for duplicate parameters with
    check_for_duplicates."""
    quadratic = DeepSpeedEngine._check_for_duplicates
    DeepSpeedEngine._check_for_duplicates = check_for_duplicates
    try:
        yield
    finally:
        DeepSpeedEngine._check_for_duplicates = quadratic


# PipelineEngine
def replace_model_step(engine: deepspeed.PipelineEngine, step: Callable[..., None]) -> Callable[..., None]:
    """Makes `step` the engine's optimizer step (clipping, the optimizer, the LR schedule, counting
    skipped steps), the one place between backward and the update; returns the engine's own."""
    original = engine._take_model_step
    engine._take_model_step = step
    return original


def loss_scale(engine: deepspeed.PipelineEngine) -> float:
    """fp16's current loss scale, as the engine reads it."""
    return engine._get_optimizer_loss_scale()


def checkpoint_engine(engine: deepspeed.PipelineEngine) -> CheckpointEngine:
    return engine.checkpoint_engine


def set_checkpoint_engine(engine: deepspeed.PipelineEngine, writer: CheckpointEngine) -> None:
    engine.checkpoint_engine = writer


def replace_recovery_scripts(engine: deepspeed.PipelineEngine, write: Callable[[str], None]) -> None:
    """A save with ZeRO (or bf16) has global rank 0 copy DeepSpeed's zero_to_fp32.py and zero_to_torch.py
    into the save directory (DeepSpeedEngine._copy_recovery_script(save_path)); `write(save_path)` runs
    instead."""
    engine._copy_recovery_script = write


def wrap_instructions(engine: deepspeed.PipelineEngine, wrap: Callable[[str, Callable], Callable]) -> list[str]:
    """Runs each pipeline instruction of this engine (ForwardPass, SendActivation, ...) through what
    `wrap(name, method)` returns; returns the instruction names. The engine looks its instructions up
    in a class-level map, which an instance attribute shadows: other engines are untouched, and a
    second wrap wraps the first."""
    instructions = engine._INSTRUCTION_MAP
    engine._INSTRUCTION_MAP = {kind: wrap(kind.__name__, method) for kind, method in instructions.items()}
    return [kind.__name__ for kind in instructions]


def backward_in_one_call(engine: deepspeed.PipelineEngine) -> None:
    """A stage that sends several float tensors on (the stage where the encoder ends sends the decoder
    state and encoder_out) gets their gradients back, and DeepSpeed's BackwardPass runs one backward per
    tensor, all but the last with retain_graph. The decoder state depends on encoder_out, so the
    encoder's backward ran twice, doubling that stage's backward. Here those calls are collected into
    one torch.autograd.backward over all the tensors: each node runs once, on the summed gradient."""

    def wrap(name: str, method: Callable) -> Callable:
        if name != "BackwardPass":
            return method

        def backward_pass(engine: deepspeed.PipelineEngine, **kwargs: Any) -> None:
            if engine.is_last_stage():  # one loss, one call
                return method(engine, **kwargs)
            with tensor_backwards_joined():
                method(engine, **kwargs)

        return backward_pass

    wrap_instructions(engine, wrap)


@contextlib.contextmanager
def tensor_backwards_joined() -> Iterator[None]:
    """Within the block, Tensor.backward calls that retain the graph are held, and run together with the
    next call that does not (or at the block's end) as one torch.autograd.backward."""
    held: list[tuple[Tensor, Tensor | None]] = []
    tensor_backward = torch.Tensor.backward

    def run_held() -> None:
        tensors, gradients = zip(*held, strict=True)
        held.clear()
        torch.autograd.backward(tensors, gradients)

    def backward(tensor: Tensor, gradient: Tensor | None = None, retain_graph: bool | None = None, **kwargs: Any):
        if kwargs:  # create_graph or inputs: not DeepSpeed's per-output pattern
            return tensor_backward(tensor, gradient, retain_graph, **kwargs)
        held.append((tensor, gradient))
        if not retain_graph:
            run_held()

    torch.Tensor.backward = backward
    try:
        yield
        if held:
            run_held()
    finally:
        torch.Tensor.backward = tensor_backward


def typed_receive_buffers(engine: deepspeed.PipelineEngine) -> None:
    """Gives the engine's receive buffers one per (position in the message, dtype). DeepSpeed keeps one
    list of them by position alone, for the activations a stage receives and the gradients it gets back
    alike, and reuses a buffer whenever it has elements enough, whatever its dtype. Only a middle stage
    receives both, and they differ where its stage crosses from the encoder to the decoder: it receives
    (x, src_tokens, prev_output_tokens) and gets back the gradients of (y, encoder_out), so after a
    backward the token ids of the next micro-batch arrive in encoder_out's float gradient buffer. gloo
    aborts on the byte count ("Received data size doesn't match expected size. 96 vs 48"), or, sent fewer
    bytes than the buffer holds, takes them as the buffer's type. Sharing a buffer between the two kinds is
    safe: received activations are copied out at once, and a received gradient is used up by the
    BackwardPass that follows its RecvGrad in the same step of DeepSpeed's schedule."""
    buffers: dict[tuple[int, torch.dtype], Tensor] = {}

    def allocate_or_extend(position: int, shape: list[int], dtype: torch.dtype) -> Tensor:
        size = math.prod(shape)
        buffer = buffers.get((position, dtype))
        if buffer is None or buffer.numel() < size:
            buffer = buffers[position, dtype] = torch.zeros(size, dtype=dtype, device=engine.device)
        return buffer[:size].view(shape)

    engine._allocate_or_extend_buffers = allocate_or_extend


def clear_pipe_buffers(engine: deepspeed.PipelineEngine) -> None:
    """Drops the last step's activations and outputs, whose autograd graph holds the engine's hooks."""
    for buffer in engine.pipe_buffers.values():
        buffer.clear()
    engine.loss = None


@contextlib.contextmanager
def universal_loading(engine: deepspeed.PipelineEngine) -> Iterator[None]:
    """Within the block, load_checkpoint reads a universal checkpoint (what `"checkpoint": {"load_universal":
    true}` makes every load read); the engine's config stays as it was for later loads."""
    config = engine._config
    before, config.load_universal_checkpoint = config.load_universal_checkpoint, True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


# ZeRO-1's optimizer
FUSED_SCANS = ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct")
SHARED_NORMS = "fathom_gradient_norms"  # the optimizer's attribute that holds set_gradient_scans' GradientNorms


class GradientNorms:
    """Each gradient's 2-norm in `dtype`, measured once for as long as the gradient is unchanged: in one
    step fathom's stability guard, ZeRO's check for non-finite gradients and its gradient norm all read
    the same gradient tensors, and each pass is a full read of them (at 6L-6L d 512 bf16 on a CPU, 38
    and 81 ms of an 880 ms step for the guard's and the check's)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        # id(gradient) -> (the gradient, weakly: a new tensor may reuse a freed one's id, and a freed
        # one's entry goes with it; its version when measured; its 2-norm)
        self.measured: dict[int, tuple[weakref.ref, int, Tensor]] = {}

    def _known(self, g: Tensor) -> Tensor | None:
        ref, version, norm = self.measured.get(id(g), (None, -1, None))
        return norm if ref is not None and ref() is g and version == g._version else None

    def _forget(self, key: int, _: weakref.ref) -> None:
        self.measured.pop(key, None)

    def __call__(self, grads: list[Tensor]) -> list[Tensor]:
        found = [self._known(g) for g in grads]
        missing = [g for g, norm in zip(grads, found, strict=True) if norm is None]
        fresh = torch._foreach_norm([g.data for g in missing], 2, dtype=self.dtype) if missing else []
        for g, norm in zip(missing, fresh, strict=True):
            self.measured[id(g)] = (weakref.ref(g, partial(self._forget, id(g))), g._version, norm)
        fresh = iter(fresh)
        return [next(fresh) if norm is None else norm for norm in found]


def gradient_norms(engine: deepspeed.PipelineEngine) -> GradientNorms | None:
    """The fp64 gradient norms ZeRO's fused scans take their verdict and norm from (set_gradient_scans),
    for whatever reads the same gradients in the same step first; None where DeepSpeed's own scans run."""
    return vars(engine.optimizer).get(SHARED_NORMS)


def set_gradient_scans(engine: deepspeed.PipelineEngine, fused: bool) -> None:
    """Whether ZeRO's two scans over the gradient partition before each step, its check for non-finite
    gradients and its gradient norm, run as one pass of multi-tensor ops instead of several ops per
    tensor in each (DeepSpeed's check: amax, amin, two isfinite and a sum, about 40 ATen ops per
    parameter tensor on a CPU, 40% of a 6L-6L engine step's, 7 kernel launches per tensor on a GPU; its
    norm: an fp64 copy and a norm per tensor). Both read every gradient's 2-norm in fp64 from one
    GradientNorms (`gradient_norms`), which fathom's stability guard fills first in the same step: a
    tensor's fp64 2-norm is finite exactly when every element is (a NaN or inf makes it so, and squares
    of finite fp32, bf16 or fp16 values cannot overflow fp64's range), and the norm counts the tensors
    DeepSpeed's counts, in the same dtype. Same verdicts and norms as DeepSpeed's. Not fused:
    DeepSpeed's own. Only for ZeRO's optimizer without offloading."""
    optimizer = engine.optimizer
    if not hasattr(optimizer, FUSED_SCANS[0]) or optimizer.cpu_offload:
        return
    for name in (*FUSED_SCANS, SHARED_NORMS):
        vars(optimizer).pop(name, None)
    if not fused:
        return
    dtype = get_norm_dtype()
    norms = GradientNorms(dtype)
    if dtype == torch.float64:  # what the check measures; an fp32 norm reads the gradients anew anyway
        setattr(optimizer, SHARED_NORMS, norms)

    def has_overflow_partitioned_grads_serial() -> Tensor:
        grads = [g for i in range(len(optimizer.bit16_groups)) for g in optimizer.averaged_gradients[i]]
        grads = [g for g in grads if g is not None and g.numel()]
        if not grads:
            return torch.zeros(1, dtype=torch.bool, device=engine.device)
        if dtype != torch.float64:  # fp32 squares of large gradients could overflow: their inf-norms
            return torch.stack(torch._foreach_norm(grads, math.inf)).isfinite().all().logical_not().view(1)
        return torch.stack(norms(grads)).isfinite().all().logical_not().view(1)

    def get_grad_norm_direct(gradients: list[Tensor], params: list[nn.Parameter], norm_type: float = 2) -> Tensor:
        if norm_type != 2:
            return type(optimizer).get_grad_norm_direct(optimizer, gradients, params, norm_type)
        # DeepSpeed's count: no partition padding, a parameter the pipeline replicates (a tied table) on
        # one stage only, a parameter model parallelism does not split on its first rank only
        unpadded = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        counted = [
            g
            for g, p in zip(unpadded, params, strict=False)
            if not getattr(p, "ds_pipe_replicated", False)
            and (is_model_parallel_parameter(p) or optimizer.model_parallel_rank == 0)
        ]
        if counted:
            squares = torch.stack(norms(counted)).pow(2).sum().float()
        else:
            squares = torch.zeros((), dtype=torch.float32, device=engine.device)
        torch.distributed.all_reduce(squares, group=optimizer.dp_process_group)
        optimizer._model_parallel_all_reduce(tensor=squares, op=torch.distributed.ReduceOp.SUM)
        norm = squares.pow(1 / 2)
        mask_nan_or_inf_with_val_inplace(norm, device=optimizer.device)  # -1: not finite
        return norm

    optimizer.has_overflow_partitioned_grads_serial = has_overflow_partitioned_grads_serial
    optimizer.get_grad_norm_direct = get_grad_norm_direct


def set_self_reduction(engine: deepspeed.PipelineEngine, skipped: bool) -> None:
    """Whether an engine with one data-parallel replica skips its gradient all-reduce at each step. There,
    DeepSpeed still copies every gradient into one flat buffer (`cat`), all-reduces it with itself,
    divides it by 1 and copies each gradient back: the identity, at three passes over the gradients and
    a few ATen ops per parameter tensor (at 6L-6L d 512 bf16, one micro-batch, 1,567 ATen ops per layer
    with it and 1,375 without). ZeRO-1 still runs its reduce step, which builds the gradient partition
    from the gradients themselves. Not skipped: DeepSpeed's own. ZeRO-1 with gradients accumulated in
    fp32 under bf16 weights reduces into a buffer of its own and is left as it is."""
    optimizer = engine.optimizer
    one_replica = not gradients_all_reduced(engine.grid.get_data_parallel_world_size())
    if engine.zero_optimization_stage() == 0:
        engine.pipeline_enable_backward_allreduce = not (skipped and one_replica)
    elif hasattr(optimizer, "buffered_reduce_fallback"):
        vars(optimizer).pop("buffered_reduce_fallback", None)
        if skipped and one_replica and optimizer.sequence_parallel_size == 1:
            optimizer.buffered_reduce_fallback = lambda *args, **kwargs: None


# ZeRO-1 parameters
def zero_sharded(param: nn.Parameter) -> bool:
    """Whether ZeRO-1 keeps `param`'s gradient in slices over the data-parallel ranks."""
    return getattr(param, "_hp_mapping", None) is not None


def zero_gradient_slice(param: nn.Parameter) -> Tensor:
    """The slice of a zero_sharded parameter's averaged gradient that this rank's partition holds."""
    return param._hp_mapping.get_lp_grad_fragment(param._index_in_param_group)
