"""The single-process encoder-decoder: the reference for tests, generation and export.

It is built from the very layer classes the pipeline runs, and its module names are fairseq's
(encoder.embed_tokens, encoder.layers.N, decoder.output_projection, ...), so a pipeline
checkpoint loads into it layer by layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from model.cache import DecoderCache
from model.config import NUM_SPECIAL, ModelConfig
from model.embedding import Embedding
from model.layers import DecoderLayer, EncoderLayer
from model.norms import build_scheme


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig, embed_tokens: Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.embed_dim) if build_scheme(cfg).normalize_before else None

    def forward(self, src_tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens.embed(src_tokens)
        for layer in self.layers:
            x = layer(x, src_tokens)
        return x if self.layer_norm is None else self.layer_norm(x)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, embed_tokens: Embedding, output_projection: Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.embed_dim) if build_scheme(cfg).normalize_before else None
        self.output_projection = output_projection

    def features(
        self,
        prev_output_tokens: torch.Tensor,
        encoder_out: torch.Tensor,
        src_tokens: torch.Tensor,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """Hidden states before the output projection. With a cache (incremental decoding),
        prev_output_tokens holds only the newest position of each prefix the cache holds."""
        start = 0 if cache is None else cache.length
        x = self.embed_tokens.embed(prev_output_tokens, start)
        for i, layer in enumerate(self.layers):
            x = layer(x, encoder_out, src_tokens, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length += prev_output_tokens.size(1)
        return x if self.layer_norm is None else self.layer_norm(x)

    def forward(
        self, prev_output_tokens: torch.Tensor, encoder_out: torch.Tensor, src_tokens: torch.Tensor
    ) -> torch.Tensor:
        return self.output_projection.project(self.features(prev_output_tokens, encoder_out, src_tokens))


def learned_positions(cfg: ModelConfig) -> int:
    """Rows of a learned position table (Embedding's learned_positions); 0: sinusoids."""
    return cfg.max_positions if cfg.learned_pos else 0


def build_embeddings(cfg: ModelConfig) -> tuple[Embedding, Embedding, Embedding]:
    """(encoder input, decoder input, output projection) tables, shared as the config says."""
    scheme, positions = build_scheme(cfg), learned_positions(cfg)
    src = Embedding(cfg.src_vocab_size, cfg.embed_dim, cfg.dropout, scheme.embedding_scale("encoder"), positions)
    if cfg.share_all_embeddings:
        return src, src, src
    tgt = Embedding(cfg.tgt_vocab_size, cfg.embed_dim, cfg.dropout, scheme.embedding_scale("decoder"), positions)
    if cfg.share_decoder_input_output_embed:
        return src, tgt, tgt
    return src, tgt, Embedding(cfg.tgt_vocab_size, cfg.embed_dim)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        src_embed, tgt_embed, output_projection = build_embeddings(cfg)
        self.encoder = Encoder(cfg, src_embed)
        self.decoder = Decoder(cfg, tgt_embed, output_projection)

    def forward(self, src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary, (batch, target length, vocab)."""
        return self.decoder(prev_output_tokens, self.encoder(src_tokens), src_tokens)


def module_names(cfg: ModelConfig) -> list[str]:
    """The model's parts in forward order, by their fairseq names (tied tables under every alias)."""
    final_norm = build_scheme(cfg).normalize_before
    return (
        ["encoder.embed_tokens"]
        + [f"encoder.layers.{i}" for i in range(cfg.encoder_layers)]
        + (["encoder.layer_norm"] if final_norm else [])
        + ["decoder.embed_tokens"]
        + [f"decoder.layers.{i}" for i in range(cfg.decoder_layers)]
        + (["decoder.layer_norm"] if final_norm else [])
        + ["decoder.output_projection"]
    )


def saved_names(cfg: ModelConfig) -> list[str | None]:
    """module_names(cfg), with None for every later use of a table shared with an earlier name: a
    pipeline checkpoint has one file per name (DeepSpeed saves a tied layer under its first use).

    Only the embedding tables are ever shared, so only they are built (on the meta device: which object
    is which, no memory); the sizes do not matter."""
    with torch.device("meta"):
        tables = build_embeddings(dataclasses.replace(cfg, src_vocab_size=NUM_SPECIAL, tgt_vocab_size=NUM_SPECIAL))
    names_of_tables = ("encoder.embed_tokens", "decoder.embed_tokens", "decoder.output_projection")
    table_of = dict(zip(names_of_tables, tables, strict=True))
    seen: set[int] = set()
    names: list[str | None] = []
    for name in module_names(cfg):
        table = table_of.get(name)
        names.append(None if table is not None and id(table) in seen else name)
        if table is not None:
            seen.add(id(table))
    return names
