"""A training step built and timed in this one process, in plain PyTorch: a fixed batch without padding,
the plain loop (AdamW and the label-smoothed loss) and a timer that waits for the device. The benchmarks
(tools/training_speed.py, tools/step_profile.py, tools/stage_balance.py) and the tests that time or
compare steps build on these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fathom.corpus.batches import MicroBatch, collate
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import NUM_SPECIAL

# ds_configs/default.json's optimizer, here for both the plain loops and the engine.
ADAMW = {"lr": 0.001, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.0001, "fused": True}


def deepspeed_config(
    batch: int,
    bf16: bool,
    micro_batches: int = 1,
    zero_stage: int | None = None,
    clipping: float = 0.0,
    checkpoint_interval: int = 0,
) -> dict[str, Any]:
    """The plain loop's step as a DeepSpeed pipeline config: one stage, `micro_batches` of `batch` pairs
    per step, torch's AdamW, no LR schedule; by default one micro-batch, no activation checkpointing and
    no gradient clipping. bf16 as training runs it: ZeRO-1 unless told (fp32 master weights; fathom
    refuses bf16 without ZeRO, which cannot resume)."""
    return {
        "train_batch_size": batch * micro_batches,
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": micro_batches,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {**ADAMW, "torch_adam": True}},  # Adam type + adam_w_mode: AdamW
        "zero_optimization": {"stage": (1 if bf16 else 0) if zero_stage is None else zero_stage},
        "bf16": {"enabled": bf16},
        "gradient_clipping": clipping,
        "pipeline": {"stages": 1, "activation_checkpoint_interval": checkpoint_interval},
    }


Step = Callable[[], object]


def synchronized(step: Step, device: str) -> Step:
    """`step`, returning only once the device has finished its work: a GPU runs asynchronously, and
    a step timed without this measures the host queueing kernels."""
    if not device.startswith("cuda"):
        return step

    def step_and_wait() -> None:
        step()
        torch.cuda.synchronize(device)

    return step_and_wait


def to_device(batch: MicroBatch, device: str) -> MicroBatch:
    """`batch`'s tensors on `device`."""
    (src_tokens, prev_output_tokens), target = batch
    return (src_tokens.to(device), prev_output_tokens.to(device)), target.to(device)


def time_steps(step: Step, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step`, after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        tick = time.perf_counter()
        step()
        times.append(time.perf_counter() - tick)
    return times


def synthetic_batch(vocab: int, batch: int, src_len: int, tgt_len: int) -> MicroBatch:
    """`batch` random pairs in the training layout (corpus.batches.collate), every one exactly src_len
    and tgt_len tokens long with eos."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(NUM_SPECIAL, vocab, (batch, src_len - 1), generator=gen)
    tgt = torch.randint(NUM_SPECIAL, vocab, (batch, tgt_len - 1), generator=gen)
    return collate(list(zip(src, tgt, strict=True)))


def weights_dtype(precision: str) -> torch.dtype:
    """What a plain loop holds its parameters in: bf16 only for pure bf16 (autocast keeps fp32 weights)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def plain_loop(
    model: nn.Module,
    logits: Callable[..., torch.Tensor],
    batch: MicroBatch,
    precision: str,
    device: str,
    micro_batches: int = 1,
) -> Step:
    """One optimizer step of the single-process training loop: AdamW, label-smoothed loss, gradients
    accumulated over `micro_batches` passes of `batch`. `model` is already on `device` in
    weights_dtype(precision)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    (src_tokens, prev_output_tokens), target = to_device(batch, device)
    autocast = torch.autocast(torch.device(device).type, torch.bfloat16, enabled=precision == "autocast")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            with autocast:
                loss = label_smoothed_cross_entropy(logits(src_tokens, prev_output_tokens), target)
            (loss / micro_batches).backward()
        optimizer.step()

    return synchronized(step, device)
