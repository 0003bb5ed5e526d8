"""model/parts.py's parts in the form DeepSpeed's PipelineModule runs them (GPT-NeoX's `*Pipe` pattern).

Each part's pipe class is a subclass of its module class whose forward takes and returns one tuple of
tensors, because that is all that crosses a stage boundary; being a subclass, it has the module
class's parameter names, so one layer file loads into either. Token ids ride along as integer tensors
(never floats, which DeepSpeed would expect gradients for), so only the first stage reads inputs and
only the last reads labels:

    (src_tokens, prev_output_tokens)                      -> encoder embedding
    (x, src_tokens, prev_output_tokens)                   -> encoder layers [, encoder.layer_norm]
    (encoder_out, src_tokens, prev_output_tokens)         -> decoder embedding (encoder_out: the encoder's x)
    (y, encoder_out, src_tokens)                          -> decoder layers (the last returns y alone)
    y                                                     -> [decoder.layer_norm,] output projection

Nothing here imports DeepSpeed (pipeline/parts/specs.py makes the LayerSpecs), so export, the memory planner
and the stage benchmark build and run these forms in one process, exactly as the engine would. The
class names are part of the interface: `pipeline.partition=type:REGEX` and activation checkpointing
select layers by them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from fathom.model.embedding import Embedding
from fathom.model.layers import DecoderLayer, EncoderLayer
from fathom.model.model_config import ModelConfig
from fathom.model.norms import NormScheme
from fathom.model.parts import Part, model_parts

Activations = tuple[Tensor, ...]


class EncoderEmbeddingPipe(Embedding):
    def forward(self, inputs: Activations) -> Activations:
        src_tokens, prev_output_tokens = inputs
        return self.embed(src_tokens), src_tokens, prev_output_tokens


class EncoderLayerPipe(EncoderLayer):
    def forward(self, inputs: Activations) -> Activations:
        x, src_tokens, prev_output_tokens = inputs
        return super().forward(x, src_tokens), src_tokens, prev_output_tokens


class EncoderNormPipe(nn.LayerNorm):
    def forward(self, inputs: Activations) -> Activations:
        x, src_tokens, prev_output_tokens = inputs
        return super().forward(x), src_tokens, prev_output_tokens


def embed_decoder_inputs(embedding: Embedding, inputs: Activations) -> Activations:
    encoder_out, src_tokens, prev_output_tokens = inputs
    return embedding.embed(prev_output_tokens), encoder_out, src_tokens


class DecoderEmbeddingPipe(Embedding):
    def forward(self, inputs: Activations) -> Activations:
        return embed_decoder_inputs(self, inputs)


class DecoderLayerPipe(DecoderLayer):
    def __init__(self, cfg: ModelConfig, scheme: NormScheme, last: bool):
        super().__init__(cfg, scheme)
        # The last layer drops encoder_out: a float sent to a later stage that gets no gradient
        # back stalls DeepSpeed's backward pass.
        self.last = last

    def forward(self, inputs: Activations) -> Activations | Tensor:
        y, encoder_out, src_tokens = inputs
        y = super().forward(y, encoder_out, src_tokens)
        return y if self.last else (y, encoder_out, src_tokens)


def project_output(embedding: Embedding, y: Tensor) -> Tensor:
    return embedding.project(y)


class OutputProjectionPipe(Embedding):
    def forward(self, y: Tensor) -> Tensor:
        return self.project(y)


# The pipe classes of Transformer layers: what stage cuts count and activation checkpointing wraps.
TRANSFORMER_LAYERS = [EncoderLayerPipe.__name__, DecoderLayerPipe.__name__]

# by a part's name without its layer index
PIPE_CLASSES: dict[str, type[nn.Module]] = {
    "encoder.embed_tokens": EncoderEmbeddingPipe,
    "encoder.layers": EncoderLayerPipe,
    "encoder.layer_norm": EncoderNormPipe,
    "decoder.embed_tokens": DecoderEmbeddingPipe,
    "decoder.layers": DecoderLayerPipe,
    "decoder.layer_norm": nn.LayerNorm,  # after the last decoder layer only y is left
    "decoder.output_projection": OutputProjectionPipe,
}
# what a later use of a shared table runs on it (DeepSpeed's TiedLayerSpec forward_fn)
TIED_FORWARDS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "decoder.embed_tokens": embed_decoder_inputs,
    "decoder.output_projection": project_output,
}


@dataclass(frozen=True, kw_only=True)
class PipePart(Part):
    """A part as the pipeline builds and runs it."""

    pipe_class: type[nn.Module]  # a later use of a shared table: its first use's, as DeepSpeed's spec names it
    kwargs: dict[str, Any] = field(default_factory=dict)
    tied_forward: Callable[[nn.Module, Any], Any] | None = None  # a later use of a shared table only

    def build(self) -> nn.Module:
        return self.pipe_class(*self.args, **self.kwargs)

    def run(self, module: nn.Module, activations: Any) -> Any:
        """What the pipeline runs for this part on `module`, its pipe class (or a shared table)."""
        return module(activations) if self.tied_forward is None else self.tied_forward(module, activations)


def pipe_parts(cfg: ModelConfig) -> list[PipePart]:
    """model_parts(cfg) in their pipeline form, in forward order; index i is DeepSpeed's layer i."""
    last_layer = f"decoder.layers.{cfg.decoder_layers - 1}"
    firsts: dict[str, PipePart] = {}  # the first use of each shared table
    parts = []
    for part in model_parts(cfg):
        kind = re.sub(r"\.\d+$", "", part.name)
        if part.reused:
            first = firsts[part.tie]
            parts.append(PipePart(**vars(part), pipe_class=first.pipe_class, tied_forward=TIED_FORWARDS[kind]))
            continue
        kwargs = {"last": part.name == last_layer} if kind == "decoder.layers" else {}
        parts.append(PipePart(**vars(part), pipe_class=PIPE_CLASSES[kind], kwargs=kwargs))
        if part.tie is not None:
            firsts[part.tie] = parts[-1]
    return parts
