"""The model's parts, written down once: their fairseq names, classes, arguments and shared tables.

Everything that builds or names the model derives from `model_parts`: the single-process
Transformer (model/transformer.py), the pipeline's LayerSpecs (pipeline/specs.py), the names of a
checkpoint's layer files, export and the memory planner. Nothing here imports DeepSpeed.

Each part also has a flat form, the class the pipeline builds: a subclass of the plain layer whose
forward takes and returns one tuple of tensors, because that is all that crosses a stage boundary.
Token ids ride along as integer tensors (never floats, which DeepSpeed would expect gradients for),
so only the first stage reads inputs and only the last reads labels:

    (src_tokens, prev_output_tokens)                      -> encoder embedding
    (x, src_tokens, prev_output_tokens)                   -> encoder layers [, encoder.layer_norm]
    (encoder_out, src_tokens, prev_output_tokens)         -> decoder embedding (encoder_out: the encoder's x)
    (y, encoder_out, src_tokens)                          -> decoder layers (the last returns y alone)
    y                                                     -> [decoder.layer_norm,] output projection
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from model.embedding import Embedding
from model.layers import DecoderLayer, EncoderLayer
from model.model_config import ModelConfig
from model.norms import build_scheme

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
    def __init__(self, cfg: ModelConfig, last: bool):
        super().__init__(cfg)
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


# The flat classes of Transformer layers: what stage cuts count and activation checkpointing wraps.
TRANSFORMER_LAYERS = [EncoderLayerPipe.__name__, DecoderLayerPipe.__name__]


@dataclass(frozen=True)
class Part:
    """One module of the model, under its fairseq name (encoder.layers.3, decoder.output_projection)."""

    name: str
    plain: type[nn.Module]  # what the single-process Transformer builds
    flat: type[nn.Module]  # what the pipeline builds: a subclass of `plain` taking one tuple
    args: tuple[Any, ...]
    flat_kwargs: dict[str, Any] = field(default_factory=dict)
    # Parts with one `tie` share one module, built and saved by the first of them; each later use runs
    # it through `tied_forward` (DeepSpeed's TiedLayerSpec forward_fn).
    tie: str | None = None
    tied_forward: Callable[[nn.Module, Any], Any] | None = None

    @property
    def saved(self) -> bool:
        """Whether a checkpoint has a layer file for this part (a tied table: its first use only)."""
        return self.tied_forward is None

    def build(self, flat: bool = False) -> nn.Module:
        return self.flat(*self.args, **self.flat_kwargs) if flat else self.plain(*self.args)

    def run(self, module: nn.Module, activations: Any) -> Any:
        """What the pipeline runs for this part on `module`, its flat form (or a tied table)."""
        return module(activations) if self.tied_forward is None else self.tied_forward(module, activations)


def reuse(owner: Part, name: str, forward: Callable[[nn.Module, Any], Any]) -> Part:
    """A later use of `owner`'s table under another name."""
    return dataclasses.replace(owner, name=name, tied_forward=forward)


def model_parts(cfg: ModelConfig) -> list[Part]:
    """Every part of the model in forward order: the pipeline's layer list."""
    scheme, dim = build_scheme(cfg), cfg.embed_dim
    positions = cfg.max_positions if cfg.learned_pos else 0
    src = (cfg.src_vocab_size, dim, cfg.dropout, scheme.embedding_scale("encoder"), positions)
    tgt = (cfg.tgt_vocab_size, dim, cfg.dropout, scheme.embedding_scale("decoder"), positions)
    encoder_embed = Part("encoder.embed_tokens", Embedding, EncoderEmbeddingPipe, src)
    decoder_embed = Part("decoder.embed_tokens", Embedding, DecoderEmbeddingPipe, tgt)
    output = Part("decoder.output_projection", Embedding, OutputProjectionPipe, (cfg.tgt_vocab_size, dim))
    # the tie keys name DeepSpeed's tied modules in checkpoints: they stay as they are
    if cfg.share_all_embeddings:
        encoder_embed = dataclasses.replace(encoder_embed, tie="embed")
        decoder_embed = reuse(encoder_embed, decoder_embed.name, embed_decoder_inputs)
        output = reuse(encoder_embed, output.name, project_output)
    elif cfg.share_decoder_input_output_embed:
        decoder_embed = dataclasses.replace(decoder_embed, tie="decoder_embed")
        output = reuse(decoder_embed, output.name, project_output)

    final_norms = scheme.normalize_before
    last = cfg.decoder_layers - 1
    return [
        encoder_embed,
        *(Part(f"encoder.layers.{i}", EncoderLayer, EncoderLayerPipe, (cfg,)) for i in range(cfg.encoder_layers)),
        *([Part("encoder.layer_norm", nn.LayerNorm, EncoderNormPipe, (dim,))] if final_norms else []),
        decoder_embed,
        *(
            Part(f"decoder.layers.{i}", DecoderLayer, DecoderLayerPipe, (cfg,), {"last": i == last})
            for i in range(cfg.decoder_layers)
        ),
        *([Part("decoder.layer_norm", nn.LayerNorm, nn.LayerNorm, (dim,))] if final_norms else []),
        output,
    ]


def build_parts(parts: Iterable[Part], flat: bool = False) -> Iterator[nn.Module]:
    """A module for each part in either form, tied parts sharing one, built one at a time as the
    caller asks for it (export streams a deep model); modules are in training mode."""
    tables: dict[str, nn.Module] = {}
    for part in parts:
        if part.tied_forward is not None:
            yield tables[part.tie]
            continue
        module = part.build(flat)
        if part.tie is not None:
            tables[part.tie] = module
        yield module


def module_names(cfg: ModelConfig) -> list[str]:
    """The model's parts in forward order, by their fairseq names (tied tables under every alias)."""
    return [part.name for part in model_parts(cfg)]


def saved_names(cfg: ModelConfig) -> list[str | None]:
    """module_names(cfg), with None for every later use of a shared table: a pipeline checkpoint has a
    file per layer index, and DeepSpeed saves a tied layer under its first use only."""
    return [part.name if part.saved else None for part in model_parts(cfg)]
