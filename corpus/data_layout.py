"""The layout of a prepared data directory (fathom-prepare's --out), owned here and nowhere else, as
common/run_layout.py owns a run directory's: every module that writes or reads one names its files through
these functions (tests/test_imports.py refuses the names spelled elsewhere). corpus/dataset.py says what
each file holds; meta.json is run_layout's META_FILE (a run directory refuses to be one)."""

from __future__ import annotations

JOINT_SPM = "spm.model"  # one SentencePiece model for both languages


def dictionary_file(lang: str) -> str:
    """fairseq's dictionary of `lang` (`token count` per line), the name fairseq's commands read too."""
    return f"dict.{lang}.txt"


def spm_file(lang: str | None) -> str:
    """The SentencePiece model of `lang`, or the joint one (None)."""
    return JOINT_SPM if lang is None else f"spm.{lang}.model"


def token_file(split: str, lang: str) -> str:
    """A split's token ids in one language, every sentence concatenated (memory-mapped)."""
    return f"{split}.{lang}.bin"


def index_file(split: str, lang: str) -> str:
    """A split's sentence offsets into its token_file (n + 1 int64)."""
    return f"{split}.{lang}.idx.npy"
