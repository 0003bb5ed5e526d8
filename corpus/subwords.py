"""The SentencePiece model(s) a data directory is encoded with: trained on a seeded sample of the
training sentences, or given (shared across shards or language pairs)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm

from fathom.common.errors import ConfigError
from fathom.corpus.text import decode_line, raw_lines

# SentencePiece's default. Its model depends on the thread count (the EM sums in another order), so the
# count is fixed: the same command gives the same model whatever --workers is.
TRAINING_THREADS = 16


def sample_indices(total: int, size: int, seed: int) -> np.ndarray | None:
    """Which of `total` sentences SentencePiece trains on, in corpus order; None: every one."""
    if size >= total:
        return None
    return np.sort(np.random.default_rng(seed).choice(total, size, replace=False))


def sampled_sentences(files: list[Path], skip: np.ndarray, chosen: np.ndarray | None) -> Iterator[str]:
    """The chosen sentences of `files`, read one after another: sentences are numbered over the files in
    turn, leaving out the lines in `skip` (pairs dropped as empty)."""
    skipped = set(skip.tolist())
    kept, found = 0, 0
    target = None if chosen is None or not len(chosen) else int(chosen[0])
    for path in files:
        for lineno, raw in enumerate(raw_lines(path)):
            if lineno in skipped:
                continue
            if chosen is None or kept == target:
                yield decode_line(raw, path, lineno + 1)
                if chosen is not None:
                    found += 1
                    if found == len(chosen):
                        return
                    target = int(chosen[found])
            kept += 1


def train(sentences: Iterable[str], path: Path, vocab_size: int, model_type: str) -> Path:
    """A model trained on `sentences`, written to `path`."""
    model = io.BytesIO()  # not model_prefix: the model would record that path, a temporary one
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            # Our dictionary adds <s>, <pad>, </s> itself; SentencePiece keeps only its <unk> (id 0).
            bos_id=-1,
            eos_id=-1,
            num_threads=TRAINING_THREADS,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise ConfigError(f"SentencePiece: {str(err).splitlines()[-1]}; try a smaller --vocab-size") from None
    try:
        path.write_bytes(model.getvalue())
    except OSError as err:
        raise ConfigError(
            f"SentencePiece: cannot write its model ({err.strerror}); is {path.parent.parent} full?"
        ) from None
    return path


def check_model(path: Path, vocab_size: int | None, option: str) -> None:
    """A given model, refused in one line if it is not one or has another size than --vocab-size."""
    if not path.is_file():
        raise ConfigError(f"{option} {path}: no such file")
    try:
        processor = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError):
        raise ConfigError(f"{option} {path}: not a SentencePiece model; give a .model file spm_train wrote") from None
    if vocab_size is not None and processor.get_piece_size() != vocab_size:
        raise ConfigError(
            f"{option} {path}: has {processor.get_piece_size()} pieces but --vocab-size is {vocab_size}; "
            "give the matching model, or leave --vocab-size out"
        )
