"""A WMT-sized stand-in corpus from Multi30k's sentences, for timing data preparation at scale.

Each pair joins two random Multi30k training pairs (about 24 words a side, WMT's typical sentence
length); the same seed gives the same corpus. Real text, so SentencePiece and the dictionaries see
a real vocabulary, but no model trained on it learns anything beyond Multi30k.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fathom.corpus.text import read_lines, shipped_data

MULTI30K = shipped_data() / "multi30k"
CHUNK = 100_000  # pairs written at a time


def write_standin(prefix: Path, pairs: int, src: str = "de", tgt: str = "en", seed: int = 0) -> None:
    """PREFIX.SRC and PREFIX.TGT: `pairs` line-aligned plain-text lines each."""
    sides = {lang: np.array(read_lines(MULTI30K / f"train.{lang}.gz"), dtype=object) for lang in (src, tgt)}
    rng = np.random.default_rng(seed)
    files = {lang: open(f"{prefix}.{lang}", "w", encoding="utf-8") for lang in sides}  # noqa: SIM115
    try:
        for start in range(0, pairs, CHUNK):
            first, second = rng.integers(0, len(sides[src]), size=(2, min(CHUNK, pairs - start)))
            for lang, f in files.items():
                f.writelines(f"{a} {b}\n" for a, b in zip(sides[lang][first], sides[lang][second], strict=True))
    finally:
        for f in files.values():
            f.close()
