"""The pipeline model as one flat list of LayerSpecs over the layers of `model/`.

Activations cross stage boundaries as tuples of tensors. Token ids ride along as integer
tensors (never floats, which DeepSpeed would expect gradients for), so only the first stage
reads inputs and only the last reads labels:

    (src_tokens, prev_output_tokens)                      -> encoder embedding
    (x, src_tokens, prev_output_tokens)                   -> encoder layers [, encoder.layer_norm]
    (y, encoder_out, src_tokens)                          -> decoder embedding, decoder layers
    y                                                     -> [decoder.layer_norm,] output projection
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import Tensor, nn

from model.config import ModelConfig
from model.embedding import Embedding
from model.layers import DecoderLayer, EncoderLayer
from model.norms import build_scheme
from model.transformer import learned_positions, saved_names

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


# Partitioning counts these; activation checkpointing wraps only these.
TRANSFORMER_LAYERS = ["EncoderLayerPipe", "DecoderLayerPipe"]


class SpecBuilder:
    """Builds the module of each spec in turn, outside the engine; tied specs reuse the module of
    their first use, as DeepSpeed does."""

    def __init__(self, training: bool = False) -> None:
        self.training = training
        self.tied: dict[str, nn.Module] = {}

    def __call__(self, spec: LayerSpec) -> nn.Module:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied:
                self.tied[spec.key] = spec.build().train(self.training)
            return self.tied[spec.key]
        return spec.build().train(self.training)


def run_layer(spec: LayerSpec, module: nn.Module, activations: Activations | Tensor) -> Activations | Tensor:
    """What the engine runs for a spec: its forward_fn on the module (tied re-uses), else the module."""
    forward_fn = getattr(spec, "forward_fn", None)
    return forward_fn(module, activations) if forward_fn else module(activations)


def layer_specs(cfg: ModelConfig) -> list[tuple[str | None, LayerSpec]]:
    """(reference module name, spec) for every pipeline layer, in order.

    The name says where the layer's checkpoint file loads in the single-process Transformer;
    it is None for tied uses that DeepSpeed does not save (it saves the first use only).
    """
    dim, dropout = cfg.embed_dim, cfg.dropout
    scheme, positions = build_scheme(cfg), learned_positions(cfg)
    src_args = (cfg.src_vocab_size, dim, dropout, scheme.embedding_scale("encoder"), positions)
    tgt_args = (cfg.tgt_vocab_size, dim, dropout, scheme.embedding_scale("decoder"), positions)
    if cfg.share_all_embeddings:
        encoder_embed = TiedLayerSpec("embed", EncoderEmbeddingPipe, *src_args)
        decoder_embed = TiedLayerSpec("embed", EncoderEmbeddingPipe, *src_args, forward_fn=embed_decoder_inputs)
        output = TiedLayerSpec("embed", EncoderEmbeddingPipe, *src_args, forward_fn=project_output)
    elif cfg.share_decoder_input_output_embed:
        encoder_embed = LayerSpec(EncoderEmbeddingPipe, *src_args)
        decoder_embed = TiedLayerSpec("decoder_embed", DecoderEmbeddingPipe, *tgt_args)
        output = TiedLayerSpec("decoder_embed", DecoderEmbeddingPipe, *tgt_args, forward_fn=project_output)
    else:
        encoder_embed = LayerSpec(EncoderEmbeddingPipe, *src_args)
        decoder_embed = LayerSpec(DecoderEmbeddingPipe, *tgt_args)
        output = LayerSpec(OutputProjectionPipe, cfg.tgt_vocab_size, dim)

    final_norms = scheme.normalize_before
    specs = [
        encoder_embed,
        *(LayerSpec(EncoderLayerPipe, cfg) for _ in range(cfg.encoder_layers)),
        *([LayerSpec(EncoderNormPipe, dim)] if final_norms else []),
        decoder_embed,
        *(LayerSpec(DecoderLayerPipe, cfg, last=i == cfg.decoder_layers - 1) for i in range(cfg.decoder_layers)),
        *([LayerSpec(nn.LayerNorm, dim)] if final_norms else []),
        output,
    ]
    # named as the single-process model's modules, in the same forward order
    return list(zip(saved_names(cfg), specs, strict=True))
