"""Token embeddings with fairseq's scaling and sinusoidal positions, also usable as the output projection."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from fathom.model.dropout import Dropout
from fathom.model.model_config import PAD


@functools.lru_cache(maxsize=8)
def sinusoidal_table(num_positions: int, dim: int, padding_idx: int = PAD) -> torch.Tensor:
    """fairseq's table: [sin | cos] halves (not interleaved), zero row at padding_idx."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_positions, dtype=torch.float)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    table[padding_idx] = 0
    return table


def positions_of(tokens: torch.Tensor, padding_idx: int = PAD, start: int = 0) -> torch.Tensor:
    """Positions counted over non-pad tokens from padding_idx + 1, so left or right padding give the same;
    `start`: the tokens continue a prefix of that many (unpadded) tokens, as in incremental decoding."""
    mask = tokens.ne(padding_idx).long()
    return (torch.cumsum(mask, dim=1) + start) * mask + padding_idx


def table_rows(positions: int) -> int:
    """Rows of the sinusoid table to build for `positions`, rounded up so that decoding one position at a
    time reuses one cached table instead of building a new one per step."""
    return -(-positions // 256) * 256


def _normal_rows(table: nn.Embedding, std: float) -> None:
    nn.init.normal_(table.weight, mean=0.0, std=std)
    with torch.no_grad():
        table.weight[table.padding_idx].zero_()


class Embedding(nn.Embedding):
    """embed(): dropout(sqrt(d) * E[tokens] + positions); project(): logits x E^T (tied output layer).

    Positions are fairseq's sinusoids, or with `learned_positions` > 0 a trained table of that many
    positions (fairseq's --encoder/decoder-learned-pos)."""

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        dropout: float = 0.0,
        init_scale: float = 1.0,
        learned_positions: int = 0,
        padding_idx: int = PAD,
    ):
        super().__init__(vocab_size, embed_dim, padding_idx=padding_idx)
        _normal_rows(self, init_scale * embed_dim**-0.5)
        self.positions = None
        if learned_positions:
            # fairseq's LearnedPositionalEmbedding: rows up to padding_idx + max positions
            self.positions = nn.Embedding(learned_positions + padding_idx + 1, embed_dim, padding_idx=padding_idx)
            _normal_rows(self.positions, embed_dim**-0.5)
        self.scale = math.sqrt(embed_dim)
        self.dropout = Dropout(dropout)

    def position_embeddings(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        positions = positions_of(tokens, self.padding_idx, start)
        if self.positions is not None:
            return self.positions(positions)
        table = sinusoidal_table(table_rows(int(positions.max()) + 1), self.embedding_dim, self.padding_idx)
        return table.to(self.weight)[positions]

    def embed(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """`start`: tokens continue an unpadded prefix of that many tokens (incremental decoding)."""
        return self.dropout(self.scale * super().forward(tokens) + self.position_embeddings(tokens, start))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
