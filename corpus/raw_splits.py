"""The raw text of each split preparation reads (PREFIX.SRC and PREFIX.TGT), and the first pass over it:
both sides line-aligned UTF-8 and every .gz whole before anything is trained, the pairs with an empty
side, and the held-out pairs that are training pairs too.
"""

from __future__ import annotations

import collections
import itertools
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fathom.common.errors import ConfigError
from fathom.corpus import filters
from fathom.corpus.binarize import CHUNK
from fathom.corpus.text import decode_line, raw_lines


@dataclass(frozen=True)
class SplitFiles:
    """One split: its name (train, valid, test, test1, ...), the prefix given, its source and target files."""

    name: str
    prefix: str
    files: tuple[Path, Path]


@dataclass
class Scan:
    """What a first pass over a split learns: its size, and which pairs have an empty side."""

    lines: int
    empty: np.ndarray  # line numbers (0-based)
    pairs: list[tuple[str, str]]  # held-out splits only: their pairs, for the overlap check


def scan(split: SplitFiles, held_out: set[tuple[str, str]] | None, seen: set[tuple[str, str]]) -> Scan:
    """Reads a split whole once, checking it before anything is trained: both sides line-aligned UTF-8,
    every .gz whole. Training pairs found in `held_out` are added to `seen`; a split with `held_out`
    None is one, and keeps its pairs."""
    src_path, tgt_path = split.files
    empty, pairs = array("q"), []
    counts = [0, 0]
    with tqdm(desc=f"reading {split.name}", unit=" pairs", unit_scale=True, leave=False) as progress:
        for raw_src, raw_tgt in itertools.zip_longest(raw_lines(src_path), raw_lines(tgt_path)):
            if raw_src is None or raw_tgt is None:
                counts[raw_src is None] += 1
                continue
            line = counts[0]
            try:
                pair = decode_line(raw_src, src_path, line + 1), decode_line(raw_tgt, tgt_path, line + 1)
            except ConfigError:
                # A damaged .gz inflates to garbage before its checksum fails at the end: that is the error.
                for path in split.files:
                    collections.deque(raw_lines(path), maxlen=0)
                raise
            counts[0] += 1
            counts[1] += 1
            if filters.empty(*pair):
                empty.append(line)
            elif held_out is None:
                pairs.append(pair)
            elif pair in held_out:
                seen.add(pair)
            if counts[0] % CHUNK == 0:
                progress.update(CHUNK)
    if counts[0] != counts[1]:
        raise ConfigError(
            f"{src_path} has {counts[0]} lines but {tgt_path} has {counts[1]}; the sides must be line-aligned"
        )
    if len(empty) == counts[0]:
        raise ConfigError(f"{split.prefix}: no pair with text on both sides")
    return Scan(counts[0], np.frombuffer(empty, dtype=np.int64), pairs)


HELD_OUT_WARNING = 0.01  # Multi30k's valid and test splits each share 1 pair of ~1,000 with train


def check_held_out(splits: list[SplitFiles], scans: dict[str, Scan], seen: set[tuple[str, str]]) -> None:
    """Validation and test pairs that are also training pairs measure memory, not translation: a split
    made only of them (the train prefix given again) is refused, and more than 1% is a warning."""
    for split in splits[1:]:
        pairs = scans[split.name].pairs
        overlap = sum(pair in seen for pair in pairs)
        where = f"{split.name} ({split.prefix})"
        if overlap == len(pairs):
            raise ConfigError(f"{where}: every pair is also a training pair; give held-out data")
        if overlap > HELD_OUT_WARNING * len(pairs):
            print(f"fathom: warning: {where}: {overlap} of {len(pairs)} pairs are training pairs too", file=sys.stderr)
