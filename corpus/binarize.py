"""Encoding a parallel corpus chunk by chunk, on every core, into SentencePiece ids.

The main process reads both sides in lockstep and hands chunks of pairs to worker processes, which
decode, encode and filter them; their results come back in order and are written in order, so the
output is the same bytes whatever the number of workers. Memory holds a few chunks, not the corpus.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from fathom.corpus.filters import FilterSettings, Pairs, apply
from fathom.corpus.text import decode_line

CHUNK = 20_000  # pairs a worker encodes at a time
BLOCK = 1 << 24  # ids a pass over a whole split's file (counting, remapping) holds at a time


@dataclass
class Chunk:
    first_line: int  # 0-based line number of the chunk's first pair
    files: tuple[str, str]  # for error messages
    lines: tuple[list[bytes], list[bytes]]
    train: bool


@dataclass
class Encoded:
    """A chunk's kept pairs: per side, their ids concatenated, their lengths and their raw text; and
    the counts of corpus.filters.apply."""

    ids: tuple[np.ndarray, np.ndarray]
    lengths: tuple[np.ndarray, np.ndarray]
    raw: tuple[bytes, bytes]
    pairs_read: int
    counts: dict[str, int]


_processors: tuple[spm.SentencePieceProcessor, spm.SentencePieceProcessor] | None = None


def load_processors(models: tuple[str, str]) -> None:
    """Worker initializer: the source and target models (the same file when joint)."""
    global _processors
    src = spm.SentencePieceProcessor(model_file=models[0])
    _processors = (src, src if models[1] == models[0] else spm.SentencePieceProcessor(model_file=models[1]))


def id_dtype(size: int) -> np.dtype:
    return np.dtype("uint16") if size < 2**16 else np.dtype("int32")


def encode_chunk(chunk: Chunk, settings: FilterSettings) -> Encoded:
    """The chunk's pairs encoded, less those corpus.filters drop with these settings of their options."""
    assert _processors is not None, "load_processors first"
    texts = [
        [decode_line(raw, name, chunk.first_line + i + 1) for i, raw in enumerate(lines)]
        for lines, name in zip(chunk.lines, chunk.files, strict=True)
    ]
    ids = [processor.encode(side, out_type=int) for processor, side in zip(_processors, texts, strict=True)]
    lengths = np.array([list(map(len, side)) for side in ids], dtype=np.int64)
    keep, counts = apply(Pairs((texts[0], texts[1]), lengths), settings, chunk.train)
    if not keep.all():
        kept = np.flatnonzero(keep)
        texts = [[side[i] for i in kept] for side in texts]
        ids = [[side[i] for i in kept] for side in ids]
        lengths = lengths[:, keep]
    dtypes = [id_dtype(p.get_piece_size()) for p in _processors]
    flat = [
        np.fromiter(itertools.chain.from_iterable(side), dtype, count=int(n.sum()))
        for side, dtype, n in zip(ids, dtypes, lengths, strict=True)
    ]
    raw = ["".join(line + "\n" for line in side).encode("utf-8") for side in texts]
    return Encoded(
        ids=(flat[0], flat[1]),
        lengths=(lengths[0], lengths[1]),
        raw=(raw[0], raw[1]),
        pairs_read=len(chunk.lines[0]),
        counts=counts,
    )


class Workers:
    """`workers` processes that encode chunks in order, or this process alone for 1. At most two
    chunks per worker are in flight, so reading never runs ahead of encoding by more."""

    def __init__(self, workers: int, models: tuple[str, str]):
        self.workers = workers
        self.pool = (
            None if workers == 1 else ProcessPoolExecutor(workers, initializer=load_processors, initargs=(models,))
        )
        if self.pool is None:
            load_processors(models)

    def map(self, fn: Callable, tasks: Iterable, *args) -> Iterator:
        if self.pool is None:
            yield from (fn(task, *args) for task in tasks)
            return
        pending: deque = deque()
        for task in tasks:
            pending.append(self.pool.submit(fn, task, *args))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def remap(spm_ids: Path, out: Path, lookup: np.ndarray, spm_dtype: np.dtype) -> None:
    """SentencePiece ids -> dictionary ids, a block at a time (read, not memory-mapped: a mapping keeps
    every page it read resident, GBs at WMT size); the SentencePiece file is removed."""
    with spm_ids.open("rb") as source, out.open("wb") as f:
        while len(block := np.fromfile(source, dtype=spm_dtype, count=BLOCK)):
            lookup[block].tofile(f)
    spm_ids.unlink()
