"""Dictionaries and memory-mapped binarized corpora (no DeepSpeed here: generation and export use them too).

A data directory written by scripts/prepare_data.py holds, for languages SRC and TGT:

    meta.json                   languages, splits, sizes, filtering counts, and the size and SHA-256
                                of every other file, verified before use
    dict.SRC.txt, dict.TGT.txt  fairseq dictionaries (`token count` per line)
    spm.model | spm.SRC.model, spm.TGT.model   SentencePiece model(s)
    SPLIT.LANG.bin              token ids of every sentence, concatenated (memory-mapped)
    SPLIT.LANG.idx.npy          sentence offsets into the .bin (n + 1 int64)
    SPLIT.raw.LANG              the split's original text, line-aligned with the .bin
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch

from fathom.common.errors import ConfigError
from fathom.common.files import write_atomic
from fathom.common.run_layout import DICTIONARIES_FILE, META_FILE
from fathom.corpus.data_layout import dictionary_file, index_file, spm_file, token_file
from fathom.model.model_config import EOS, NUM_SPECIAL, PAD, SPECIAL_SYMBOLS, UNK, ModelConfig

PADDING_FACTOR = 8  # fairseq-preprocess pads dictionaries to a multiple of 8 with madeupwordNNNN


class Dictionary:
    """fairseq's index order: <s>=0, <pad>=1, </s>=2, <unk>=3, then the file's tokens."""

    def __init__(self, symbols: list[str], counts: list[int]):
        self.symbols = list(SPECIAL_SYMBOLS) + list(symbols)
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


class IndexedDataset:
    """Sentences of token ids, read from a memory-mapped file: a corpus larger than RAM works."""

    def __init__(self, index: Path, data: Path, dtype: str):
        try:
            self.offsets = np.load(index)
        except (ValueError, OSError, EOFError) as err:
            raise ConfigError(f"{index}: not an index ({err}); the file is damaged: {RERUN}") from None
        self.data = np.memmap(data, dtype=dtype, mode="r") if data.stat().st_size else np.zeros(0, dtype)
        if self.offsets.ndim != 1 or len(self.offsets) == 0 or self.offsets[-1] != len(self.data):
            raise ConfigError(
                f"{data}: {len(self.data)} tokens, but {index.name} indexes {self.offsets[-1:].sum()}; the files "
                "are damaged or from different data: rerun scripts/prepare_data.py"
            )
        self.lengths = np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        start, stop = self.offsets[index], self.offsets[index + 1]
        return torch.from_numpy(self.data[start:stop].astype(np.int64))


def file_record(path: Path) -> dict[str, int | str]:
    """What meta.json keeps of a file prepare_data wrote: its size and SHA-256."""
    with path.open("rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


RERUN = "rerun scripts/prepare_data.py"


def read_meta(path: Path) -> dict:
    """meta.json, with the keys every reader relies on."""
    if not path.is_file():
        raise ConfigError(f"{path.parent}: not a prepared data directory (no meta.json); run scripts/prepare_data.py")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); the data directory is damaged: {RERUN}") from None
    required = {"src": str, "tgt": str, "dtype": str, "splits": dict}
    for key, kind in required.items():
        if not isinstance(meta, dict) or not isinstance(meta.get(key), kind):
            raise ConfigError(f"{path}: no {kind.__name__} '{key}'; the data directory is damaged: {RERUN}")
    for name, split in meta["splits"].items():
        if not isinstance(split, dict) or not isinstance(split.get("pairs"), int):
            raise ConfigError(f"{path}: split '{name}' has no pair count; the data directory is damaged: {RERUN}")
    if meta["dtype"] not in ("uint16", "int32"):
        raise ConfigError(f"{path}: dtype {meta['dtype']!r}; the data directory is damaged: {RERUN}")
    return meta


class PreparedData:
    """A prepared data directory's languages and dictionaries: what translating raw text needs. Every file
    is verified against meta.json before use: present, of its size, and unless `checksums` is False (a
    process whose machine has another verify them), of its checksum."""

    def __init__(self, path: str | Path, checksums: bool = True):
        self.path, self.checksums = Path(path), checksums
        self.meta = read_meta(self.path / META_FILE)
        self.files: dict[str, dict] | None = self.meta.get("files")
        if self.files is None:
            print(
                f"fathom: warning: {self.path}: prepared by an older fathom, without checksums: its files are not "
                f"verified; {RERUN} to have them verified",
                file=sys.stderr,
            )
        self.src, self.tgt = self.meta["src"], self.meta["tgt"]
        self.src_dict = Dictionary.load(self.verified(dictionary_file(self.src)))
        self.tgt_dict = Dictionary.load(self.verified(dictionary_file(self.tgt)))
        self.src_vocab_size, self.tgt_vocab_size = len(self.src_dict), len(self.tgt_dict)

    def verified(self, name: str) -> Path:
        """The directory's file `name`, once checked to be the very file prepare_data wrote there."""
        path = self.path / name
        if not path.is_file():
            raise ConfigError(f"{path}: missing from the data directory; {RERUN}")
        if self.files is None:
            return path
        if name not in self.files:
            raise ConfigError(f"{path}: not a file prepare_data wrote here (not in meta.json); {RERUN}")
        expected, size = self.files[name], path.stat().st_size
        if size != expected.get("bytes"):
            raise ConfigError(
                f"{path}: {size} bytes, but prepare_data wrote {expected.get('bytes')}; the file is damaged or "
                f"from other data: {RERUN}"
            )
        if self.checksums and file_record(path) != expected:
            raise ConfigError(f"{path}: fails its checksum; the file is damaged or from other data: {RERUN}")
        return path

    def target_text(self, ids: Iterable[int], detokenizer: spm.SentencePieceProcessor) -> str:
        """Target token ids as the raw text sacreBLEU scores: the dictionary's pieces, with `detokenizer`
        (the target language's SentencePiece model) removing SentencePiece."""
        return detokenizer.decode_pieces(self.tgt_dict.decode(ids))

    def sentencepiece_model(self, lang: str) -> Path:
        """The SentencePiece model for `lang` (joint or per language)."""
        for name in (spm_file(lang), spm_file(None)):
            if (self.path / name).exists():
                return self.verified(name)
        raise ConfigError(f"{self.path}: no SentencePiece model ({spm_file(None)} or {spm_file(lang)}); {RERUN}")


class BinarizedCorpus(PreparedData):
    """One split of a prepared data directory, as a ParallelCorpus."""

    def __init__(self, path: str | Path, split: str, checksums: bool = True):
        super().__init__(path, checksums)
        path = self.path
        if split not in self.meta["splits"]:
            raise ConfigError(f"{path}: no split '{split}'; it has {', '.join(self.meta['splits'])}")
        self.split = split
        self.sources, self.targets = (self.sentences(lang) for lang in (self.src, self.tgt))
        if len(self.sources) != len(self.targets) or len(self.sources) != self.meta["splits"][split]["pairs"]:
            raise ConfigError(
                f"{path}: split '{split}' has {len(self.sources)} source and {len(self.targets)} target sentences, "
                f"meta.json says {self.meta['splits'][split]['pairs']} pairs; the data directory is damaged: {RERUN}"
            )
        if len(self.sources) == 0:
            raise ConfigError(f"{path}: split '{split}' has no pairs; {RERUN} with data for it")
        for lang, sentences, size in (
            (self.src, self.sources, self.src_vocab_size),
            (self.tgt, self.targets, self.tgt_vocab_size),
        ):
            if len(sentences.data) and (largest := int(sentences.data.max())) >= size:
                raise ConfigError(
                    f"{path}/{token_file(split, lang)}: token id {largest}, but {dictionary_file(lang)} has {size} "
                    "entries; the "
                    "dictionary does not belong to this data: rerun scripts/prepare_data.py"
                )

    def sentences(self, lang: str) -> IndexedDataset:
        split = self.split
        return IndexedDataset(self.verified(index_file(split, lang)), self.verified(token_file(split, lang)),
                              self.meta["dtype"])  # fmt: skip

    def references(self) -> Path:
        """The split's target side as raw text: what translations are scored against."""
        return self.verified(f"{self.split}.raw.{self.tgt}")

    def __len__(self) -> int:
        return len(self.sources)

    def pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sources[index], self.targets[index]

    def lengths(self) -> np.ndarray:
        """Per pair, the longer side's length including eos: what a token budget counts."""
        return np.maximum(self.sources.lengths, self.targets.lengths) + 1

    def fingerprint(self) -> dict[str, Any]:
        """The split's token files' SHA-256 as meta.json records them (for data prepared without
        checksums: its directory and pair count)."""
        if self.files is None:
            return {"path": str(self.path.resolve()), "pairs": len(self)}
        names = [name(self.split, lang) for lang in (self.src, self.tgt) for name in (token_file, index_file)]
        return {name: self.files[name]["sha256"] for name in names}


class ShardedCorpus(PreparedData):
    """One split of a corpus prepared as shards that share one vocabulary (prepare_data --vocab-from the
    first), read as one corpus: the first shard's pairs, then the second's, ... Every epoch shuffles
    across all of them, as if they were one directory; memory-mapped, that costs no more than one."""

    def __init__(self, paths: list[str | Path], split: str, checksums: bool = True):
        self.shards = [BinarizedCorpus(path, split, checksums) for path in paths]
        first = self.shards[0]
        super().__init__(first.path, checksums)
        for shard in self.shards[1:]:
            check_same_vocabulary(first, shard)
        self.starts = np.cumsum([0] + [len(shard) for shard in self.shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.shards[shard].pair(index - int(self.starts[shard]))

    def lengths(self) -> np.ndarray:
        return np.concatenate([shard.lengths() for shard in self.shards])

    def fingerprint(self) -> dict[str, Any]:
        return {"shards": [shard.fingerprint() for shard in self.shards]}


def check_same_vocabulary(first: PreparedData, shard: PreparedData) -> None:
    """Shards are one corpus only if a token id means the same piece in each: the same languages,
    dictionaries and SentencePiece models, byte for byte (their checksums in meta.json)."""
    fix = f"prepare it with --vocab-from {first.path}"
    if (shard.src, shard.tgt) != (first.src, first.tgt):
        raise ConfigError(
            f"data.path: shard {shard.path} is {shard.src}->{shard.tgt}, but {first.path} is {first.src}->{first.tgt}"
        )
    langs = (first.src, first.tgt)
    for name in (*map(dictionary_file, langs), spm_file(None), *map(spm_file, langs)):
        records = [(data.files or {}).get(name, {}).get("sha256") for data in (first, shard)]
        if records[0] != records[1] or (records[0] is None and first.files is None):
            raise ConfigError(f"data.path: shard {shard.path} has another {name} than {first.path}; {fix}")


def dictionary_digests(directory: Path, langs: Iterable[str]) -> dict[str, str]:
    """The SHA-256 of a directory's dictionaries dict.LANG.txt, by file name."""
    names = sorted({dictionary_file(lang) for lang in langs})
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in names}


def record_dictionaries(save_dir: str | Path, digests: dict[str, str], data: Path) -> None:
    """Records in save_dir the dictionaries its weights were trained with, and the data they came from."""
    text = json.dumps({"data": str(data), "sha256": digests}, indent=2)
    write_atomic(Path(save_dir) / DICTIONARIES_FILE, text + "\n")


def write_dictionaries(save_dir: str | Path, corpus: PreparedData) -> None:
    record_dictionaries(save_dir, dictionary_digests(corpus.path, (corpus.src, corpus.tgt)), corpus.path)


def check_vocab(
    save_dir: str | Path, cfg: ModelConfig, corpus: PreparedData, fix: str = "use the run's data directory"
) -> None:
    """Fails unless the data directory's dictionaries are the ones the run in save_dir was trained with
    (by content where the run or the import recorded them, by size for older runs); `fix` ends the line."""
    data = corpus.path
    if (cfg.src_vocab_size, cfg.tgt_vocab_size) != (corpus.src_vocab_size, corpus.tgt_vocab_size):
        raise ConfigError(
            f"{data}: dictionaries have {corpus.src_vocab_size}/{corpus.tgt_vocab_size} entries but the model was "
            f"trained with {cfg.src_vocab_size}/{cfg.tgt_vocab_size}; {fix}"
        )
    recorded = Path(save_dir) / DICTIONARIES_FILE
    if not recorded.exists():
        return
    trained = json.loads(recorded.read_text())
    for name, digest in dictionary_digests(corpus.path, (corpus.src, corpus.tgt)).items():
        if trained["sha256"].get(name) != digest:
            raise ConfigError(
                f"{data}: {name} is not the dictionary the run in {save_dir} was trained with "
                f"(that was {trained['data']}); {fix}"
            )
