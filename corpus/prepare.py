"""Raw parallel text -> SentencePiece model, fairseq dictionaries and a binarized, memory-mapped dataset.

    python scripts/prepare_data.py --src de --tgt en --train PREFIX --valid PREFIX [--test PREFIX ...] \\
        --vocab-size V --out DIR [--workers N] [--spm-sample N] [--max-ratio R]

PREFIX.de and PREFIX.en are raw text, plain or .gz, one sentence per line. The corpus is streamed: memory
does not grow with its size. SentencePiece trains on a seeded sample of --spm-sample sentences (every
one when there are fewer), or --spm-model gives a model (and --dict its dictionaries, e.g. those of a
model imported from fairseq); --vocab-from DIR takes a directory's models and dictionaries, so that
shards of one corpus share them. Everything is written to a temporary directory
beside DIR and renamed into place only when complete, so a failure never leaves a half-written DIR.

From Python, `prepare(PrepareOptions(src="de", tgt="en", train=..., valid=..., out=..., vocab_size=8000))`
does what the command does and returns meta.json's record; the options are the flags, with their defaults.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import shutil
import sys
from array import array
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, check_number, exit_on_config_error
from fathom.common.files import staged
from fathom.common.outputs import check_output_dir
from fathom.common.run_layout import META_FILE
from fathom.corpus import filters, subwords
from fathom.corpus.binarize import BLOCK, CHUNK, Chunk, Encoded, Workers, encode_chunk, id_dtype, remap
from fathom.corpus.dataset import Dictionary, PreparedData, file_record
from fathom.corpus.filters import FilterSettings
from fathom.corpus.text import decode_line, find_file, raw_lines
from fathom.model.model_config import UNK

SPM_SAMPLE = 500_000  # sentences: SentencePiece needs about 2.8 KB a WMT-length sentence (1.4 GB here)
SPM_SEED = 1


@dataclass(frozen=True)
class PrepareOptions:
    """What to prepare, as the command's flags say it (--spm-model is spm_model, --dict dictionaries); the
    raw text of each split is PREFIX.SRC and PREFIX.TGT, plain or .gz."""

    src: str
    tgt: str
    train: str | Path  # prefix
    valid: str | Path  # prefix
    out: str | Path
    test: tuple[str | Path, ...] = ()  # prefixes of the splits test, test1, test2, ...
    vocab_size: int | None = None  # required unless spm_model or vocab_from gives the model
    separate_vocab: bool = False
    model_type: str = "unigram"
    spm_sample: int = SPM_SAMPLE
    spm_seed: int = SPM_SEED
    spm_model: tuple[str | Path, ...] = ()  # one (both sides) or two (source, target)
    dictionaries: tuple[str | Path, ...] = ()  # with spm_model: fairseq dictionaries instead of counted ones
    vocab_from: str | Path | None = None  # a prepared directory whose models and dictionaries to use
    filters: FilterSettings = field(default_factory=FilterSettings)
    workers: int | None = None  # processes that encode; None: one per CPU this process may use
    force: bool = False  # replace an existing output directory

    def check(self) -> None:
        """Fails in one ConfigError line, naming the flag, where an option is out of range or they clash."""
        if self.src == self.tgt:
            raise ConfigError(f"--src and --tgt are both '{self.src}'; the two sides need different suffixes")
        if self.vocab_size is None and not (self.spm_model or self.vocab_from):
            raise ConfigError("--vocab-size: required unless --spm-model or --vocab-from gives the model")
        check_number("--vocab-size", self.vocab_size, 8)
        for option in filters.options():
            check_number(option.flag, self.filters.value(option), option.least, what=option.what)
        check_number("--workers", self.workers, 1)
        check_number("--spm-sample", self.spm_sample, 1, what=" sentence")
        check_number("--spm-seed", self.spm_seed, 0)  # numpy's seeds are non-negative
        if self.vocab_from and (self.spm_model or self.separate_vocab):
            raise ConfigError(
                "--vocab-from gives the models and dictionaries; leave out --spm-model and --separate-vocab"
            )
        if len(self.spm_model) > 2:
            raise ConfigError(
                f"--spm-model: {len(self.spm_model)} files; give one (both sides) or two (source, target)"
            )
        if self.spm_model and self.separate_vocab and len(self.spm_model) != 2:
            raise ConfigError("--spm-model with --separate-vocab: give two models, the source's and the target's")
        if self.dictionaries and not self.spm_model:
            raise ConfigError("--dict: give the SentencePiece model its pieces come from with --spm-model")
        if len(self.dictionaries) > 2:
            raise ConfigError(f"--dict: {len(self.dictionaries)} files; give one (both sides) or two (source, target)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with PrepareOptions' defaults."""
    parser = command_parser(__doc__)
    parser.add_argument("--src", required=True, help="source language suffix, e.g. de")
    parser.add_argument("--tgt", required=True, help="target language suffix, e.g. en")
    parser.add_argument("--train", required=True, metavar="PREFIX")
    parser.add_argument("--valid", required=True, metavar="PREFIX")
    parser.add_argument("--test", nargs="*", default=[], metavar="PREFIX", help="splits test, test1, test2, ...")
    parser.add_argument("--vocab-size", type=int, help="SentencePiece vocabulary size (a given model has its own)")
    parser.add_argument("--separate-vocab", action="store_true", help="one SentencePiece model per language")
    parser.add_argument("--model-type", default=PrepareOptions.model_type, choices=["unigram", "bpe"])
    parser.add_argument(
        "--spm-sample",
        type=int,
        default=PrepareOptions.spm_sample,
        metavar="N",
        help="SentencePiece trains on N sentences",
    )
    parser.add_argument("--spm-seed", type=int, default=PrepareOptions.spm_seed, help="seed of the sample")
    parser.add_argument(
        "--spm-model", nargs="+", type=Path, metavar="FILE", help="use this model (two: source, target) instead"
    )
    parser.add_argument(
        "--dict",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="with --spm-model: this fairseq dictionary (two: source, target) instead of one counted from the data, "
        "e.g. an imported model's",
    )
    parser.add_argument("--vocab-from", type=Path, metavar="DIR", help="a prepared directory's models and dictionaries")
    for option in filters.options():
        parser.add_argument(option.flag, type=option.type, default=option.default, help=option.help)
    parser.add_argument("--workers", type=int, help="processes that encode (default: one per CPU this may use)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class SplitFiles:
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
        names = ("spm.model",) * 2 if given.joint else tuple(f"spm.{lang}.model" for lang in langs)
        for model, name in zip(given.models, names, strict=True):
            shutil.copyfile(model, tmp / name)
        source = str(options.vocab_from) if options.vocab_from else [str(m) for m in options.spm_model]
        dictionaries = {"dictionaries": [str(path) for path in options.dictionaries]} if options.dictionaries else {}
        return Vocabulary((tmp / names[0], tmp / names[1]), given.dictionaries), {"given": source, **dictionaries}
    pairs = scanned.lines - len(scanned.empty)
    groups = [list(train.files)] if not options.separate_vocab else [[f] for f in train.files]
    paths = [tmp / "spm.model"] if not options.separate_vocab else [tmp / f"spm.{lang}.model" for lang in langs]
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
        remap(tmp / f"{name}.{lang}.spm", tmp / f"{name}.{lang}.bin", lookup, id_dtype(processor.get_piece_size()))
        write_index(tmp / f"{name}.{lang}.ends", binarized.pairs, tmp / f"{name}.{lang}.idx.npy")


def prepare(options: PrepareOptions) -> dict:
    """Prepares the data directory options.out as the command does; returns what meta.json records.
    Fails in one ConfigError line (naming the flag) before writing anything where the options or the
    data cannot be used, and leaves nothing behind when a later step fails."""
    out = Path(options.out)
    options.check()
    langs = options.src, options.tgt
    prefixes = {"train": str(options.train), "valid": str(options.valid)}
    prefixes.update({("test" if i == 0 else f"test{i}"): str(p) for i, p in enumerate(options.test)})
    splits = [SplitFiles(name, p, (find_file(p, langs[0]), find_file(p, langs[1]))) for name, p in prefixes.items()]
    # the files themselves too: a prefix's file may be a link into --out
    check_output_dir(out, options.force, META_FILE, [*prefixes.values(), *(f for s in splits for f in s.files)])
    given = given_vocabulary(options)
    scans = {split.name: scan(split, None, set()) for split in splits[1:]}
    held_out = {pair for scanned in scans.values() for pair in scanned.pairs}
    seen: set[tuple[str, str]] = set()
    scans = {"train": scan(splits[0], held_out, seen), **scans}
    check_held_out(splits, scans, seen)
    settings = options.filters
    processes = options.workers or len(os.sched_getaffinity(0))

    with staged(out) as tmp:
        vocab, spm_record = sentencepiece_models(options, given, splits[0], scans["train"], tmp)
        with Workers(processes, (str(vocab.models[0]), str(vocab.models[1]))) as workers:
            binarized = {s.name: binarize(s, scans[s.name], workers, settings, langs, tmp) for s in splits}
        if not binarized["train"].pairs:
            raise ConfigError(nothing_left(binarized["train"].counts, settings))
        if vocab.dictionaries is None:
            vocab.dictionaries = count_dictionaries(vocab, langs, tmp)
        dtype = id_dtype(max(len(d) for d in vocab.dictionaries)).name
        for lang, dictionary in zip(langs, vocab.dictionaries, strict=True):
            dictionary.save(tmp / f"dict.{lang}.txt")
        for name, split in binarized.items():
            write_split(name, split, vocab, langs, dtype, tmp)

        meta = {
            "src": options.src,
            "tgt": options.tgt,
            "joint_vocab": vocab.joint,
            "dtype": dtype,
            "vocab": {lang: len(d) for lang, d in zip(langs, vocab.dictionaries, strict=True)},
            "sentencepiece": spm_record,
            "filters": settings.record(),
            "splits": {
                s.name: {
                    "pairs": binarized[s.name].pairs,
                    **binarized[s.name].counts,
                    "longest": binarized[s.name].longest,
                    "source": s.prefix,
                }
                for s in splits
            },
            "files": {f.name: file_record(f) for f in sorted(tmp.iterdir())},
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def nothing_left(counts: dict[str, int], settings: FilterSettings) -> str:
    """The error when the filters drop every training pair: the options that dropped some, and what to
    do to each (the scan has refused a split with no pair that has text on both sides)."""
    culprits = [(f, value) for f, value in filters.active(settings) if f.option and counts[f.counter]]
    dropped = ", ".join(f"{counts[f.counter]} {f.label} {value}" for f, value in culprits)
    flags: dict[str, list[str]] = {}
    for f, _ in culprits:
        flags.setdefault(f.loosen, []).append(f.option.flag)
    advice = " or ".join(f"{verb} {' or '.join(names)}" for verb, names in flags.items())
    return f"train: no pairs left ({dropped} dropped); {advice}"


def split_summary(name: str, split: dict) -> str:
    """Per filter, the pairs it dropped; in a held-out split, only those of filters that apply there,
    and the pairs training-only filters would have dropped, kept."""
    train = name == "train"
    dropped = ", ".join(f"{split[f.counter]} {f.label}" for f in filters.FILTERS if train or f.held_out)
    kept = [f"{split[f.kept]} {f.label} kept" for f in filters.FILTERS if not train and f.kept]
    return f"{name}: {split['pairs']} pairs ({', '.join([f'{dropped} dropped', *kept])})"


def long_held_out_warning(name: str, split: dict, max_len: int) -> str | None:
    """Held-out pairs over --max-len are kept, as fairseq-preprocess keeps them: validation and test must
    see the real split. But no training pair reaches their length, and one such pair (often two lines run
    together in the raw text) can dominate a validation loss: the count is said, and launch checks them
    against model.max_positions."""
    if not split["kept_too_long"]:
        return None
    return (
        f"fathom: warning: {name} ({split['source']}): {split['kept_too_long']} of {split['pairs']} pairs are "
        f"longer than --max-len {max_len} pieces (the longest {split['longest']}); kept, as held-out pairs are, "
        "but no training pair is as long: check them for lines run together"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options = PrepareOptions(
        src=args.src,
        tgt=args.tgt,
        train=args.train,
        valid=args.valid,
        out=args.out,
        test=tuple(args.test),
        vocab_size=args.vocab_size,
        separate_vocab=args.separate_vocab,
        model_type=args.model_type,
        spm_sample=args.spm_sample,
        spm_seed=args.spm_seed,
        spm_model=tuple(args.spm_model or ()),
        dictionaries=tuple(args.dict or ()),
        vocab_from=args.vocab_from,
        filters=FilterSettings(**{option.dest: getattr(args, option.dest) for option in filters.options()}),
        workers=args.workers,
        force=args.force,
    )
    with exit_on_config_error():
        meta = prepare(options)
    for name, split in meta["splits"].items():
        print(split_summary(name, split))
        if warning := long_held_out_warning(name, split, options.filters.max_len):
            print(warning, file=sys.stderr)
    print(f"dictionaries: {meta['vocab']} entries; written to {args.out}")
