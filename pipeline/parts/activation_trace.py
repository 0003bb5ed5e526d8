"""What autograd keeps for backward, per pipeline layer, measured rather than derived: each distinct
part of the model runs forward in its pipeline form on one sentence under saved-tensor hooks, which
see exactly what backward will need, whatever the norm scheme, attention kernel and precision. The
memory model (pipeline/parts/stage_memory.py) scales these traces to micro-batches and stages, for the
memory planner (planner/) and for activation checkpointing chosen at launch (auto_checkpointing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
from torch import Tensor, nn

from fathom.common.errors import ConfigError
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import DTYPES, NUM_SPECIAL
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.parts.stage_modules import TRANSFORMER_LAYERS, PipePart, pipe_parts

T = TypeVar("T")


@dataclass
class LayerTrace:
    """One spec's module, run forward on one sentence."""

    tied_key: str | None  # specs of one tied module (shared embeddings) hold its parameters once
    params: int
    saved: int  # bytes autograd keeps for backward, riding inputs excluded
    stream: int  # bytes of the first float output: the hidden states
    riders: int  # bytes of further float outputs (encoder_out), held once per stage
    sent: int  # bytes of every output tensor, token ids included: what a stage ending here sends on
    checkpointable: bool


def planned_precision(cfg: RunConfig) -> str:
    """The run's precision as the memory planner models it: fp32 or bf16 (fp16 is refused, not guessed)."""
    if (name := cfg.settings.precision) == "fp16":
        raise ConfigError("fp16: the planner knows fp32 and bf16 runs; estimate with bf16 (same sizes)")
    return name


def _float_bytes(values: tuple) -> list[int]:
    return [v.untyped_storage().nbytes() for v in values if isinstance(v, Tensor) and v.is_floating_point()]


def _saved_bytes(run: Callable[[], object], skip: set[int]) -> tuple[object, int]:
    """run()'s result and the bytes of the distinct storages autograd saved for backward during it,
    storages in `skip` (parameters, inputs held elsewhere) left out."""
    saved: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    return output, sum(saved.values())


def _module_key(part: PipePart) -> str:
    """Parts with one key build equal modules (tied ones: the same module)."""
    if part.tie is not None:
        return f"tied:{part.tie}"
    return repr((part.pipe_class, part.args, part.kwargs))


def each_distinct_layer(
    cfg: RunConfig, tokens: Tensor, measure: Callable[[PipePart, nn.Module, object], tuple[T, object]]
) -> tuple[list[T], object]:
    """measure(part, module, inputs) -> (record, output) for every spec of the model, in order, on `tokens`
    as source and target. Each distinct layer is built and measured once: a deep stack repeats the same
    layer, whose output then stands in for the next one's input. Returns the records and the last output."""
    dtype = DTYPES[planned_precision(cfg)]
    value: object = (tokens, tokens.clone())
    modules: dict[str, nn.Module] = {}
    done: dict[str, tuple[T, object]] = {}
    records = []
    for part in pipe_parts(cfg.model):
        module_key = _module_key(part)
        key = f"{module_key}/{part.tied_forward}"
        if key not in done:
            if module_key not in modules:
                modules[module_key] = part.build().to(device=tokens.device, dtype=dtype).train()
            done[key] = measure(part, modules[module_key], value)
        record, value = done[key]
        records.append(record)
    return records, value


def _trace(part: PipePart, module: nn.Module, value: object) -> tuple[LayerTrace, object]:
    # every decoder layer reads the same encoder_out: the stage holds it once
    riding = value[1:] if isinstance(value, tuple) else ()
    skip = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *riding) if isinstance(t, Tensor)}
    output, saved = _saved_bytes(partial(part.run, module, value), skip)
    outputs = output if isinstance(output, tuple) else (output,)
    floats = _float_bytes(outputs)
    trace = LayerTrace(
        tied_key=part.tie,
        params=sum(p.numel() for p in module.parameters()),
        saved=saved,
        stream=floats[0] if floats else 0,
        riders=sum(floats[1:]),
        sent=sum(tensor.numel() * tensor.element_size() for tensor in outputs),
        checkpointable=part.pipe_class.__name__ in TRANSFORMER_LAYERS,
    )
    return trace, output


def sample_tokens(cfg: RunConfig, shape: tuple[int, int], device: torch.device | str = "cpu") -> Tensor:
    """Token ids of `shape` (sentences, length), the same every call."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(NUM_SPECIAL, cfg.model.tgt_vocab_size, shape, generator=generator).to(device)


def trace_layers(cfg: RunConfig, length: int) -> tuple[list[LayerTrace], int]:
    """A trace for every spec of the model, each on one sentence, and the bytes the loss saves."""
    tokens = sample_tokens(cfg, (1, length))
    traces, logits = each_distinct_layer(cfg, tokens, _trace)
    loss = partial(label_smoothed_cross_entropy, logits, tokens, smoothing=cfg.train.label_smoothing)
    _, loss_saved = _saved_bytes(loss, skip=set())
    return traces, loss_saved
