"""The SentencePiece models and fairseq dictionaries a prepared directory is encoded with: given
(--vocab-from, --spm-model, --dict) and copied in, or trained on the training split
(corpus/subwords.py) and counted over its kept pairs.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from fathom.common.errors import ConfigError
from fathom.corpus import subwords
from fathom.corpus.binarize import BLOCK, id_dtype
from fathom.corpus.data_layout import spm_file
from fathom.corpus.dataset import Dictionary, PreparedData
from fathom.corpus.prepare_options import PrepareOptions
from fathom.corpus.raw_splits import Scan, SplitFiles


@dataclass
class Vocabulary:
    """The SentencePiece model file per side (one file twice when joint), and the dictionaries when
    they are given rather than counted."""

    models: tuple[Path, Path]
    dictionaries: tuple[Dictionary, Dictionary] | None = None

    @property
    def joint(self) -> bool:
        return self.models[0] == self.models[1]

    def processors(self) -> list[spm.SentencePieceProcessor]:
        return [spm.SentencePieceProcessor(model_file=str(model)) for model in self.models]


def given_vocabulary(options: PrepareOptions) -> Vocabulary | None:
    """--vocab-from's or --spm-model's models (checked now, before any reading), or None: train them."""
    src, tgt = options.src, options.tgt
    if options.vocab_from:
        data = PreparedData(options.vocab_from)
        if (data.src, data.tgt) != (src, tgt):
            raise ConfigError(
                f"--vocab-from {options.vocab_from}: prepared for {data.src}->{data.tgt}, not {src}->{tgt}"
            )
        models = data.sentencepiece_model(src), data.sentencepiece_model(tgt)
        for model in set(models):
            subwords.check_model(model, options.vocab_size, "--vocab-from")
        return Vocabulary(models, (data.src_dict, data.tgt_dict))
    if options.spm_model:
        given = [Path(model) for model in options.spm_model]
        for model in given:
            subwords.check_model(model, options.vocab_size, "--spm-model")
        return Vocabulary((given[0], given[-1]), given_dictionaries([Path(path) for path in options.dictionaries]))
    return None


def given_dictionaries(paths: list[Path]) -> tuple[Dictionary, Dictionary] | None:
    """--dict's dictionaries (source, target; one file serves both), or None: count them from the data."""
    if not paths:
        return None
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"--dict {path}: no such file")
    return Dictionary.load(paths[0]), Dictionary.load(paths[-1])


def sentencepiece_models(
    options: PrepareOptions, given: Vocabulary | None, train: SplitFiles, scanned: Scan, tmp: Path
) -> tuple[Vocabulary, dict]:
    """The models, in the output directory, and what meta.json records of how they came about."""
    langs = options.src, options.tgt
    if given is not None:
        names = (spm_file(None),) * 2 if given.joint else tuple(map(spm_file, langs))
        for model, name in zip(given.models, names, strict=True):
            shutil.copyfile(model, tmp / name)
        source = str(options.vocab_from) if options.vocab_from else [str(m) for m in options.spm_model]
        dictionaries = {"dictionaries": [str(path) for path in options.dictionaries]} if options.dictionaries else {}
        return Vocabulary((tmp / names[0], tmp / names[1]), given.dictionaries), {"given": source, **dictionaries}
    pairs = scanned.lines - len(scanned.empty)
    groups = [list(train.files)] if not options.separate_vocab else [[f] for f in train.files]
    paths = [tmp / spm_file(None)] if not options.separate_vocab else [tmp / spm_file(lang) for lang in langs]
    models, samples = [], []
    for files, path in zip(groups, paths, strict=True):
        total = pairs * len(files)
        chosen = subwords.sample_indices(total, options.spm_sample, options.spm_seed)
        used = total if chosen is None else len(chosen)
        print(
            f"training SentencePiece ({options.model_type}, {options.vocab_size} pieces) on {used:,} of {total:,} "
            f"sentences{'' if chosen is None else f' (sample seed {options.spm_seed})'}"
        )
        sentences = subwords.sampled_sentences(files, scanned.empty, chosen)
        models.append(subwords.train(sentences, path, options.vocab_size, options.model_type))
        samples.append({"sentences": used, "of": total})
    record = {
        "model_type": options.model_type,
        "vocab_size": options.vocab_size,
        "seed": options.spm_seed,
        "sample": samples,
    }
    return Vocabulary((models[0], models[-1])), {"trained": record}


def piece_counts(spm_ids: Path, size: int) -> np.ndarray:
    """How often each SentencePiece id occurs in the file, a block at a time."""
    counts = np.zeros(size, dtype=np.int64)
    with spm_ids.open("rb") as f:
        while len(block := np.fromfile(f, dtype=id_dtype(size), count=BLOCK)):
            counts += np.bincount(block, minlength=size)
    return counts


def count_dictionaries(vocab: Vocabulary, langs: tuple[str, str], tmp: Path) -> tuple[Dictionary, Dictionary]:
    """fairseq's dictionaries, counted over the kept training pairs; joint models get one for both sides."""
    processors = vocab.processors()
    counts = [
        piece_counts(tmp / f"train.{lang}.spm", p.get_piece_size()) for lang, p in zip(langs, processors, strict=True)
    ]
    if vocab.joint:
        counts = [counts[0] + counts[1]] * 2
    dictionaries = [
        Dictionary.from_counts({p.id_to_piece(i): int(c) for i, c in enumerate(side) if c and i != p.unk_id()})
        for p, side in zip(processors, counts, strict=True)
    ]
    return dictionaries[0], dictionaries[1]
