"""Keys and values kept between decoding steps, so each step runs the decoder on one new position only.

A decoder layer's self-attention appends the new position's keys and values to its cache; its
encoder attention projects the encoder output once, at the first step, one row per sentence: a
sentence's beams attend over one copy of its source. Beam search reorders the rows as beams are
extended (`reorder`) and drops the rows of finished sentences (`select`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

KeysValues = tuple[torch.Tensor, torch.Tensor]
FIRST_CAPACITY = 32  # positions: most sentences never make a cache grow


class AttentionCache:
    """One attention's keys and values, (rows, heads, positions, head_dim) each.

    `static`: keys and values of a fixed sequence (the source), computed once. Otherwise the decoded
    prefix, growing by the positions of every call; it lives in the first `length` positions of buffers
    whose capacity doubles as needed, and a reorder gathers those positions of each row into a spare
    pair of buffers: a step allocates nothing, where concatenating and indexing fresh tensors made page
    faults the largest cost of a step (on a 50-layer decoder, more than the matrix products)."""

    def __init__(self, static: bool):
        self.static = static
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0
        self.spare: KeysValues | None = None

    def update(self, project: Callable[[torch.Tensor], KeysValues], key_value: torch.Tensor) -> KeysValues:
        """Keys and values to attend over, projecting only what is not cached yet."""
        if self.static:
            if self.keys is None:
                self.keys, self.values = project(key_value)
            return self.keys, self.values
        keys, values = project(key_value)
        start, stop = self.length, self.length + keys.size(2)
        if self.keys is None or stop > self.keys.size(2):
            self._grow(keys, max(2 * stop, FIRST_CAPACITY))
        self.keys[:, :, start:stop] = keys
        self.values[:, :, start:stop] = values
        self.length = stop
        return self.keys[:, :, :stop], self.values[:, :, :stop]

    def _grow(self, like: torch.Tensor, capacity: int) -> None:
        rows, heads, _, dim = like.shape
        keys, values = (like.new_empty(rows, heads, capacity, dim) for _ in range(2))
        if self.keys is not None:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values, self.spare = keys, values, None

    def select(self, rows: torch.Tensor) -> None:
        if self.keys is None:
            return
        if self.static or len(rows) != self.keys.size(0):  # the source once per sentence; a shrinking batch
            self.keys, self.values, self.spare = self.keys[rows], self.values[rows], None
            return
        if self.spare is None:
            self.spare = (torch.empty_like(self.keys), torch.empty_like(self.values))
        keys, values = self.spare
        # the filled positions only: on a deep decoder, this copy is the largest cost of a step
        filled = slice(0, self.length)
        torch.index_select(self.keys[:, :, filled], 0, rows, out=keys[:, :, filled])
        torch.index_select(self.values[:, :, filled], 0, rows, out=values[:, :, filled])
        self.spare = (self.keys, self.values)
        self.keys, self.values = keys, values


@dataclass
class LayerCache:
    """A decoder layer's caches: its self-attention's and its encoder attention's."""

    self_attn: AttentionCache = field(default_factory=lambda: AttentionCache(static=False))
    encoder_attn: AttentionCache = field(default_factory=lambda: AttentionCache(static=True))


class DecoderCache:
    """The caches of a stack of decoder layers (all of a model's, or one pipeline stage's), and how many
    target positions they hold. Rows are sentence-major, `beam` rows a sentence; the encoder attention
    keeps one row per sentence."""

    def __init__(self, num_layers: int, beam: int):
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.beam = beam
        self.length = 0

    def reorder(self, rows: torch.Tensor) -> None:
        """Row i continues from row rows[i], every row staying with its own sentence (beams re-ranked):
        only the prefixes move."""
        for layer in self.layers:
            layer.self_attn.select(rows)

    def select(self, rows: torch.Tensor) -> None:
        """Keeps the given rows, in that order, across sentences (finished sentences leave the batch)."""
        sentences = sentences_of(rows, self.beam)
        for layer in self.layers:
            layer.self_attn.select(rows)
            layer.encoder_attn.select(sentences)


def sentences_of(rows: torch.Tensor, beam: int) -> torch.Tensor:
    """The sentence of each group of `beam` rows, of rows kept whole sentences at a time."""
    return rows[::beam] // beam
