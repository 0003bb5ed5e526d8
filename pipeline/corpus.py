"""Dictionaries and memory-mapped binarized corpora (no DeepSpeed here: generation and export use them too).

A data directory written by scripts/prepare_data.py holds, for languages SRC and TGT:

    meta.json                   languages, splits, sizes, filtering counts
    dict.SRC.txt, dict.TGT.txt  fairseq dictionaries (`token count` per line)
    spm.model | spm.SRC.model, spm.TGT.model   SentencePiece model(s)
    SPLIT.LANG.bin              token ids of every sentence, concatenated (memory-mapped)
    SPLIT.LANG.idx.npy          sentence offsets into the .bin (n + 1 int64)
    SPLIT.raw.LANG              the split's original text, line-aligned with the .bin
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from model.config import EOS, NUM_SPECIAL, PAD, UNK, ConfigError

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
PADDING_FACTOR = 8  # fairseq-preprocess pads dictionaries to a multiple of 8 with madeupwordNNNN


class Dictionary:
    """fairseq's index order: <s>=0, <pad>=1, </s>=2, <unk>=3, then the file's tokens."""

    def __init__(self, symbols: list[str], counts: list[int]):
        self.symbols = SPECIALS + list(symbols)
        self.counts = [0] * NUM_SPECIAL + list(counts)
        self.index = {s: i for i, s in enumerate(self.symbols)}

    @classmethod
    def from_counts(cls, counts: dict[str, int]) -> Dictionary:
        """Most frequent first (ties alphabetical), padded like fairseq-preprocess."""
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        symbols = [s for s, _ in ranked]
        freqs = [c for _, c in ranked]
        i = 0
        while (NUM_SPECIAL + len(symbols)) % PADDING_FACTOR:
            symbols.append(f"madeupword{i:04d}")
            freqs.append(0)
            i += 1
        return cls(symbols, freqs)

    @classmethod
    def load(cls, path: str | Path) -> Dictionary:
        symbols, counts = [], []
        lines = Path(path).read_text(encoding="utf-8").split("\n")  # not splitlines: a piece may hold U+2028
        for lineno, line in enumerate(lines[:-1] if lines[-1] == "" else lines, 1):
            symbol, _, count = line.rstrip().rpartition(" ")
            if not symbol or not count.isdigit():
                raise ConfigError(f"{path}:{lineno}: expected 'token count', got {line!r}")
            symbols.append(symbol)
            counts.append(int(count))
        return cls(symbols, counts)

    def save(self, path: str | Path) -> None:
        lines = (f"{s} {c}\n" for s, c in zip(self.symbols[NUM_SPECIAL:], self.counts[NUM_SPECIAL:], strict=True))
        Path(path).write_text("".join(lines), encoding="utf-8")

    def __len__(self) -> int:
        return len(self.symbols)

    def encode(self, pieces: Iterable[str]) -> list[int]:
        return [self.index.get(p, UNK) for p in pieces]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Pieces up to the first eos, without padding."""
        pieces = []
        for i in ids:
            if i == EOS:
                break
            if i != PAD:
                pieces.append(self.symbols[i])
        return pieces


def write_indexed(prefix: Path, sequences: list[list[int]], dtype: np.dtype) -> None:
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    data = np.fromiter((t for s in sequences for t in s), dtype=dtype, count=int(offsets[-1]))
    data.tofile(prefix.with_name(prefix.name + ".bin"))
    np.save(prefix.with_name(prefix.name + ".idx.npy"), offsets)


class IndexedDataset:
    """Sentences of token ids, read from a memory-mapped file: a corpus larger than RAM works."""

    def __init__(self, prefix: Path, dtype: str):
        self.offsets = np.load(prefix.with_name(prefix.name + ".idx.npy"))
        self.data = np.memmap(prefix.with_name(prefix.name + ".bin"), dtype=dtype, mode="r")
        self.lengths = np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        start, stop = self.offsets[index], self.offsets[index + 1]
        return torch.from_numpy(self.data[start:stop].astype(np.int64))


def sentencepiece_model(data: str | Path, lang: str) -> Path:
    """The SentencePiece model for `lang` in a prepared data directory (joint or per language)."""
    for name in (f"spm.{lang}.model", "spm.model"):
        if (Path(data) / name).exists():
            return Path(data) / name
    raise ConfigError(f"{data}: no SentencePiece model (spm.model or spm.{lang}.model); run scripts/prepare_data.py")


class PreparedData:
    """A prepared data directory's languages and dictionaries: what translating raw text needs."""

    def __init__(self, path: str | Path):
        path = Path(path)
        meta_file = path / "meta.json"
        if not meta_file.exists():
            raise ConfigError(f"{path}: not a prepared data directory (no meta.json); run scripts/prepare_data.py")
        self.path = path
        self.meta = json.loads(meta_file.read_text())
        self.src, self.tgt = self.meta["src"], self.meta["tgt"]
        self.src_dict = Dictionary.load(path / f"dict.{self.src}.txt")
        self.tgt_dict = Dictionary.load(path / f"dict.{self.tgt}.txt")
        self.src_vocab_size, self.tgt_vocab_size = len(self.src_dict), len(self.tgt_dict)


class BinarizedCorpus(PreparedData):
    """One split of a prepared data directory, as a ParallelCorpus."""

    def __init__(self, path: str | Path, split: str):
        super().__init__(path)
        path = self.path
        if split not in self.meta["splits"]:
            raise ConfigError(f"{path}: no split '{split}'; it has {', '.join(self.meta['splits'])}")
        self.sources = IndexedDataset(path / f"{split}.{self.src}", self.meta["dtype"])
        self.targets = IndexedDataset(path / f"{split}.{self.tgt}", self.meta["dtype"])
        for lang, sentences, size in (
            (self.src, self.sources, self.src_vocab_size),
            (self.tgt, self.targets, self.tgt_vocab_size),
        ):
            if len(sentences.data) and (largest := int(sentences.data.max())) >= size:
                raise ConfigError(
                    f"{path}/{split}.{lang}.bin: token id {largest}, but dict.{lang}.txt has {size} entries; the "
                    "dictionary does not belong to this data: rerun scripts/prepare_data.py"
                )

    def __len__(self) -> int:
        return len(self.sources)

    def pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sources[index], self.targets[index]

    def lengths(self) -> np.ndarray:
        """Per pair, the longer side's length including eos: what a token budget counts."""
        return np.maximum(self.sources.lengths, self.targets.lengths) + 1
