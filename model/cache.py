"""Keys and values kept between decoding steps, so each step runs the decoder on one new position only.

A decoder layer's self-attention appends the new position's keys and values to its cache; its
encoder attention projects the encoder output once, at the first step. Beam search reorders the
rows as beams are extended (`reorder`) and drops the rows of finished sentences (`select`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

KeysValues = tuple[torch.Tensor, torch.Tensor]


class AttentionCache:
    """One attention's keys and values, (rows, heads, positions, head_dim) each.

    `static`: keys and values of a fixed sequence (the source), computed once; otherwise the
    decoded prefix, growing by the positions of every call."""

    def __init__(self, static: bool):
        self.static = static
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, project: Callable[[torch.Tensor], KeysValues], key_value: torch.Tensor) -> KeysValues:
        """Keys and values to attend over, projecting only what is not cached yet."""
        if self.static and self.keys is not None:
            return self.keys, self.values
        keys, values = project(key_value)
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def select(self, rows: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)


@dataclass
class LayerCache:
    """A decoder layer's caches: its self-attention's and its encoder attention's."""

    self_attn: AttentionCache = field(default_factory=lambda: AttentionCache(static=False))
    encoder_attn: AttentionCache = field(default_factory=lambda: AttentionCache(static=True))


class DecoderCache:
    """The caches of a stack of decoder layers (all of a model's, or one pipeline stage's), and how many
    target positions they hold."""

    def __init__(self, num_layers: int):
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.length = 0

    def reorder(self, rows: torch.Tensor) -> None:
        """Row i continues from row rows[i], every row staying with its own sentence (beams re-ranked):
        the encoder attention's rows are alike across a sentence's beams, so only the prefixes move."""
        for layer in self.layers:
            layer.self_attn.select(rows)

    def select(self, rows: torch.Tensor) -> None:
        """Keeps the given rows, in that order, across sentences (finished sentences leave the batch)."""
        for layer in self.layers:
            layer.self_attn.select(rows)
            layer.encoder_attn.select(rows)
