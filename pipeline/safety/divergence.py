"""Divergence handling: a non-finite loss or gradient caught on the step it happens, on every stage.

DeepSpeed 0.19.8 already skips an update whose gradients are non-finite when its own optimizer wrapper
sits in front: ZeRO-1 (its global gradient norm, or its fp16/bf16 overflow check) and the FP16 optimizer
(bf16 without ZeRO, DeepSpeed's BF16 optimizer, is refused by the config check). Their verdict is agreed
over the pipeline's stages, and the engine then counts the step in `skipped_steps` and holds the LR
schedule. Two holes remain, which StabilityGuard closes: plain fp32 without ZeRO hands the gradients
straight to the torch optimizer (with gradient_clipping, NaNs go into every weight), and a non-finite
loss can come with finite gradients (a logit overflowing to -inf). So before every optimizer step all
ranks all-reduce one small vector: the loss's finiteness, the per-layer output flags the forward pass
left (StabilityGuard's hooks) and per-layer sums of squared gradients. They then agree on the verdict,
name the first layer whose output went non-finite, and log per-layer gradient norms every
`train.grad_norm_interval` steps.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import Tensor, nn

from fathom.model.model_config import ModelConfig
from fathom.model.parts import module_names, saved_names
from fathom.pipeline.engine.internals import (
    built_stage_bounds,
    gradient_norms,
    loss_scale,
    replace_model_step,
    replace_stage_call,
    stage_layers,
    zero_gradient_slice,
    zero_sharded,
)
from fathom.pipeline.world.distributed import end_distributed

NONFINITE_EXIT = 3  # the exit status of a run stopped by a non-finite step (2: a config error)


class NonFiniteError(RuntimeError):
    """A step went non-finite with train.on_nonfinite = "stop"; the message is one line."""


@contextmanager
def exit_on_nonfinite(report: bool = True) -> Iterator[None]:
    """For scripts/train.py: a NonFiniteError ends the run with its one line on stderr (printed by
    `report` ranks) and exit status 3. Every rank raises it on the same step, so all can still meet to
    tear the process group down."""
    try:
        yield
    except NonFiniteError as err:
        if report:
            print(f"fathom: error: {err}", file=sys.stderr, flush=True)
        end_distributed()
        sys.exit(NONFINITE_EXIT)


def describe(
    loss_nonfinite: bool,
    outputs_nonfinite: list[bool],
    grads_nonfinite: list[bool],
    names: list[str],
    bounds: list[int],
) -> str | None:
    """What went non-finite in a step, one line; None if the loss and every gradient are finite.

    outputs_/grads_nonfinite are per pipeline layer; bounds: the first layer of each stage, then the layer
    count (built_stage_bounds).
    """
    if not loss_nonfinite and not any(grads_nonfinite):
        return None

    def where(layer: int) -> str:
        return f"stage {bisect.bisect_right(bounds, layer) - 1}, layer {layer} ({names[layer]})"

    found = "non-finite loss" if loss_nonfinite else "non-finite gradient"
    if any(outputs_nonfinite):
        return f"{found}; first non-finite output: {where(outputs_nonfinite.index(True))}"
    bad = [layer for layer, nonfinite in enumerate(grads_nonfinite) if nonfinite]
    if not bad:  # e.g. the loss overflowing on finite logits
        return f"{found}; every layer's output and gradient finite"
    # Backward runs from the last layer down, so the highest one is where the gradient first broke.
    return (
        f"{found}; outputs finite; non-finite parameter gradients in {len(bad)} layer(s), "
        f"the first in backward order: {where(bad[-1])}"
    )


def local_gradient(param: nn.Parameter) -> Tensor | None:
    """The gradient the optimizer will apply to `param` (after data-parallel averaging), as this rank
    holds it: deepspeed.utils.safe_get_full_grad without its per-parameter all-reduce. ZeRO-1 keeps
    only the slice in this rank's partition; without ZeRO, param.grad is the whole (averaged) gradient."""
    return zero_gradient_slice(param) if zero_sharded(param) else param.grad


def owned_share(param: nn.Parameter, grad: Tensor, data_parallel_rank: int) -> Tensor | None:
    """The part of `grad` (local_gradient) no other data-parallel rank counts, so squares summed over
    all ranks give the norm once: ZeRO-1's slices are disjoint; a whole gradient counts on rank 0."""
    if zero_sharded(param):
        return grad
    return grad if data_parallel_rank == 0 else None


class StabilityGuard:
    """Watches one pipeline engine's steps; after each one, `found` says what went non-finite (None:
    nothing) and `skipped` whether the update was left out. The bad update is always left out, so under
    train.on_nonfinite = "skip" training goes on from unchanged weights and optimizer state."""

    def __init__(
        self,
        engine: deepspeed.PipelineEngine,
        cfg: ModelConfig,
        grad_norm_interval: int = 0,
        write_norms: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.engine, self.pipe = engine, engine.module
        self.grad_norm_interval, self.write_norms = grad_norm_interval, write_norms
        self.names, self.bounds = module_names(cfg), built_stage_bounds(self.pipe)
        # Layers named in checkpoints: each holds its own parameters (a tied table: its first use).
        self.saved = saved_names(cfg)
        self.found: str | None = None
        self.skipped = False
        # (layer, min and max of its output) for every forward of this step
        self.extremes: list[tuple[int, tuple[Tensor, Tensor]]] = []
        self.params: list[nn.Parameter] = []
        self.owners: list[int] = []
        for offset, layer, func in stage_layers(self.pipe):
            if isinstance(func, nn.Module):
                func.register_forward_hook(partial(self._output_hook, layer))
                if self.saved[layer] is not None:
                    trainable = [p for p in func.parameters() if p.requires_grad]
                    self.params += trainable
                    self.owners += [layer] * len(trainable)
            else:  # a tied table's later use: DeepSpeed calls its forward_fn, which module hooks never see
                replace_stage_call(self.pipe, offset, partial(self._call_and_check, layer, func))

        optimizer = engine.optimizer
        # The engine skips a step only for optimizers that report `overflow`: DeepSpeed's own wrappers.
        self.optimizer_checks = hasattr(optimizer, "overflow")
        if not self.optimizer_checks:  # a torch optimizer, not one of DeepSpeed's wrappers
            self._guard_torch_optimizer(optimizer)
        elif getattr(optimizer, "compute_grad_norm", True) is False:
            # fp32 ZeRO without its gradient norm would check nothing: use its fp16 overflow check.
            optimizer.check_grad_overflow = True
        self.apply_update = replace_model_step(engine, self._checked_model_step)

    def _output_hook(self, layer: int, module: nn.Module, inputs: Any, output: Any) -> None:
        self._check_output(layer, output)

    def _call_and_check(self, layer: int, func: Callable[[Any], Any], inputs: Any) -> Any:
        output = func(inputs)
        self._check_output(layer, output)
        return output

    def _check_output(self, layer: int, output: Tensor | tuple[Tensor, ...]) -> None:
        if not self.pipe.training:  # validation and Admin's profiling pass are not steps
            return
        x = output[0] if isinstance(output, tuple) else output  # the layer's own output leads the tuple
        # min and max are non-finite exactly when an element is (they propagate NaN): one reduction per
        # layer, kept on the device and read once per step, so no host sync per layer.
        self.extremes.append((layer, torch.aminmax(x.detach())))

    def _guard_torch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        step = optimizer.step

        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            # The engine reads `overflow` after step(): it then counts the step skipped and holds the LR.
            optimizer.overflow = self.found is not None
            return None if optimizer.overflow else step(*args, **kwargs)

        optimizer.step = guarded_step

    def _local_summary(self, grads: list[tuple[int, Tensor]]) -> Tensor:
        """[loss non-finite, per-layer output non-finite..., per-layer squared gradient norm...] of this
        rank's share, for summing over all ranks."""
        engine, layers = self.engine, len(self.names)
        summary = torch.zeros(1 + 2 * layers, dtype=torch.float64, device=engine.device)
        if engine.is_last_stage():
            summary[0] = ~torch.isfinite(engine.total_loss).all()
        if self.extremes:
            extremes = torch.stack([v for _, pair in self.extremes for v in pair]).view(-1, 2)
            where = torch.tensor([1 + layer for layer, _ in self.extremes], device=engine.device)
            summary.index_add_(0, where, (~torch.isfinite(extremes)).any(dim=1).double())
            self.extremes.clear()
        dp_rank = engine.grid.get_data_parallel_rank()
        shares = [(i, owned_share(self.params[i], grad, dp_rank)) for i, grad in grads]
        shares = [(i, share) for i, share in shares if share is not None]
        if shares:
            # ZeRO's check and gradient norm read the same gradients next: measured once for all three
            measure = gradient_norms(engine) or partial(torch._foreach_norm, ord=2, dtype=torch.float32)
            norms = torch.stack(measure([share for _, share in shares]))
            where = torch.tensor([1 + layers + self.owners[i] for i, _ in shares], device=engine.device)
            summary.index_add_(0, where, norms.double() ** 2)
        return summary

    def _checked_model_step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        engine, layers = self.engine, len(self.names)
        step = engine.global_steps + 1
        grads = [(i, local_gradient(p)) for i, p in enumerate(self.params)]
        grads = [(i, grad) for i, grad in grads if grad is not None]
        summary = self._local_summary(grads)
        dist.all_reduce(summary)
        summary = summary.tolist()
        outputs_nonfinite = [v > 0 for v in summary[1 : 1 + layers]]
        squares = summary[1 + layers :]
        grads_nonfinite = [not math.isfinite(v) for v in squares]
        fp16 = engine.fp16_enabled()
        # fp16 gradients are loss-scaled: their overflow is routine, and DeepSpeed's loss scaler skips the
        # step and lowers the scale; only a non-finite loss is divergence there.
        self.found = describe(
            summary[0] > 0, outputs_nonfinite, [g and not fp16 for g in grads_nonfinite], self.names, self.bounds
        )
        if self.grad_norm_interval and step % self.grad_norm_interval == 0 and self.write_norms is not None:
            scale = loss_scale(engine) if fp16 else 1.0
            norms = {name: math.sqrt(squares[i]) / scale for i, name in enumerate(self.saved) if name is not None}
            self.write_norms({"step": step, "norms": norms})
        if self.found is not None and not any(grads_nonfinite) and self.optimizer_checks:
            # Finite gradients with a non-finite loss: DeepSpeed's optimizers skip only on non-finite
            # gradients, and then clean up their own buffers, so make this step's gradients non-finite.
            for _, grad in grads:
                grad.fill_(math.nan)
        skipped_before = engine.skipped_steps
        self.apply_update(lr_kwargs)
        self.skipped = engine.skipped_steps > skipped_before
        if self.found is not None and not self.skipped:
            raise RuntimeError(f"step {step}: DeepSpeed applied an update despite a {self.found}")

    def step_record(self) -> dict[str, Any]:
        """metrics.jsonl fields of the last step: fp16's loss scale after it (as fairseq logs it), and
        for a skipped step, why."""
        record = {"loss_scale": loss_scale(self.engine)} if self.engine.fp16_enabled() else {}
        if self.skipped:
            record |= {"skipped": True, "nonfinite": self.found or "fp16 gradient overflow (DeepSpeed's loss scaler)"}
        return record

    def enforce(self, policy: str, step: int, last_checkpoint: str | None) -> None:
        """Acts on a step that went non-finite (`found`): raises NonFiniteError ("stop") or reports the skip."""
        if policy == "stop":
            saved = f"the last checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved"
            raise NonFiniteError(f"step {step}: {self.found}; {saved}")
        if dist.get_rank() == 0:
            print(f"step {step}: skipped: {self.found}", flush=True)
