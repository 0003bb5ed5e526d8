"""The single-process encoder-decoder: the reference for tests, generation and export.

It is built from model/parts.py, the one description of the model the pipeline's layers also come
from, so its module names are fairseq's and the parts' (encoder.embed_tokens, encoder.layers.N,
decoder.output_projection, ...), and a pipeline checkpoint loads into it layer by layer.
"""

from __future__ import annotations

import torch
from torch import nn

from fathom.model.cache import DecoderCache
from fathom.model.embedding import Embedding
from fathom.model.model_config import ModelConfig
from fathom.model.parts import build_parts, model_parts


class Encoder(nn.Module):
    def __init__(self, embed_tokens: Embedding, layers: list[nn.Module], layer_norm: nn.LayerNorm | None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.layer_norm = layer_norm

    def forward(self, src_tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens.embed(src_tokens)
        for layer in self.layers:
            x = layer(x, src_tokens)
        return x if self.layer_norm is None else self.layer_norm(x)


class Decoder(nn.Module):
    def __init__(
        self,
        embed_tokens: Embedding,
        layers: list[nn.Module],
        layer_norm: nn.LayerNorm | None,
        output_projection: Embedding,
    ):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.layer_norm = layer_norm
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


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        parts = model_parts(cfg)
        modules = dict(zip((part.name for part in parts), build_parts(parts), strict=True))

        def stack(side: str) -> tuple[Embedding, list[nn.Module], nn.LayerNorm | None]:
            layers = [module for name, module in modules.items() if name.startswith(f"{side}.layers.")]
            return modules[f"{side}.embed_tokens"], layers, modules.get(f"{side}.layer_norm")

        self.encoder = Encoder(*stack("encoder"))
        self.decoder = Decoder(*stack("decoder"), modules["decoder.output_projection"])

    def forward(self, src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary, (batch, target length, vocab)."""
        return self.decoder(prev_output_tokens, self.encoder(src_tokens), src_tokens)
