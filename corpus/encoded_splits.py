"""Each split written into the data directory: its pairs encoded by the workers (corpus/binarize.py)
into SentencePiece ids, raw text and sentence ends, then those ids into the dictionary's (SPLIT.LANG.bin)
and the ends into the index (SPLIT.LANG.idx.npy).
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fathom.corpus import filters
from fathom.corpus.binarize import BLOCK, CHUNK, Chunk, Encoded, Workers, encode_chunk, id_dtype, remap
from fathom.corpus.data_layout import index_file, token_file
from fathom.corpus.filters import FilterSettings
from fathom.corpus.raw_splits import Scan, SplitFiles
from fathom.corpus.text import raw_lines
from fathom.corpus.vocabulary import Vocabulary
from fathom.model.model_config import UNK


def chunks(split: SplitFiles) -> Iterator[Chunk]:
    """The split's pairs, CHUNK at a time (the scan checked that the sides align)."""
    sides = [raw_lines(path) for path in split.files]
    names = (str(split.files[0]), str(split.files[1]))
    for first in itertools.count(0, CHUNK):
        lines = (list(itertools.islice(sides[0], CHUNK)), list(itertools.islice(sides[1], CHUNK)))
        if not lines[0]:
            return
        yield Chunk(first, names, lines, train=split.name == "train")


@dataclass
class Binarized:
    """A split encoded into SentencePiece ids (SPLIT.LANG.spm) and sentence end offsets
    (SPLIT.LANG.ends), with its raw text written. `counts`: corpus.filters.counters, the pairs each filter
    dropped and those a held-out split kept; `longest`: the longer side of its longest pair, in pieces."""

    pairs: int
    counts: dict[str, int]
    longest: int


def binarize(
    split: SplitFiles, scanned: Scan, workers: Workers, settings: FilterSettings, langs: tuple, tmp: Path
) -> Binarized:
    pairs, ends, longest = 0, [0, 0], 0  # ends: tokens written so far per side, where the next sentence starts
    counts = dict.fromkeys(filters.counters(), 0)
    with ExitStack() as files:
        ids_out = [files.enter_context((tmp / f"{split.name}.{lang}.spm").open("wb")) for lang in langs]
        raw_out = [files.enter_context((tmp / f"{split.name}.raw.{lang}").open("wb")) for lang in langs]
        ends_out = [files.enter_context((tmp / f"{split.name}.{lang}.ends").open("wb")) for lang in langs]
        progress = files.enter_context(
            tqdm(total=scanned.lines, desc=f"encoding {split.name}", unit=" pairs", unit_scale=True, leave=False)
        )
        encoded: Encoded
        for encoded in workers.map(encode_chunk, chunks(split), settings):
            for side in range(2):
                encoded.ids[side].tofile(ids_out[side])
                raw_out[side].write(encoded.raw[side])
                (ends[side] + np.cumsum(encoded.lengths[side])).tofile(ends_out[side])
                ends[side] += int(encoded.lengths[side].sum())
            for counter, count in encoded.counts.items():
                counts[counter] += count
            longer = np.maximum(*encoded.lengths)
            longest = max(longest, int(longer.max(initial=0)))
            pairs += len(encoded.lengths[0])
            progress.update(encoded.pairs_read)
    return Binarized(pairs, counts, longest)


def write_index(ends: Path, pairs: int, out: Path) -> None:
    """OUT (.npy, as np.save writes it): 0 and the sentence end offsets, copied a block at a time from
    ENDS, which is removed; the index of a WMT-size split is hundreds of MB."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.int64)), "fortran_order": False, "shape": (pairs + 1,)}
    with out.open("wb") as f, ends.open("rb") as source:
        np.lib.format.write_array_header_1_0(f, header)
        np.zeros(1, np.int64).tofile(f)
        shutil.copyfileobj(source, f, BLOCK)
    ends.unlink()


def write_split(
    name: str, binarized: Binarized, vocab: Vocabulary, langs: tuple[str, str], dtype: str, tmp: Path
) -> None:
    """SPLIT.LANG.bin in dictionary ids and SPLIT.LANG.idx.npy, from the split's SentencePiece ids."""
    assert vocab.dictionaries is not None
    for lang, processor, dictionary in zip(langs, vocab.processors(), vocab.dictionaries, strict=True):
        lookup = np.full(processor.get_piece_size(), UNK, dtype=dtype)
        for i in range(processor.get_piece_size()):
            if i != processor.unk_id():
                lookup[i] = dictionary.index.get(processor.id_to_piece(i), UNK)
        remap(tmp / f"{name}.{lang}.spm", tmp / token_file(name, lang), lookup, id_dtype(processor.get_piece_size()))
        write_index(tmp / f"{name}.{lang}.ends", binarized.pairs, tmp / index_file(name, lang))
