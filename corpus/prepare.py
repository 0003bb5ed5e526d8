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
import json
import os
import sys
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.files import staged
from fathom.common.outputs import check_output_dir
from fathom.common.run_layout import META_FILE
from fathom.corpus import filters
from fathom.corpus.binarize import Workers, id_dtype
from fathom.corpus.data_layout import dictionary_file
from fathom.corpus.dataset import file_record
from fathom.corpus.encoded_splits import binarize, write_split
from fathom.corpus.filters import FilterSettings
from fathom.corpus.prepare_options import PrepareOptions
from fathom.corpus.raw_splits import SplitFiles, check_held_out, scan
from fathom.corpus.text import find_pair
from fathom.corpus.vocabulary import count_dictionaries, given_vocabulary, sentencepiece_models


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


def prepare(options: PrepareOptions) -> dict:
    """Prepares the data directory options.out as the command does; returns what meta.json records.
    Fails in one ConfigError line (naming the flag) before writing anything where the options or the
    data cannot be used, and leaves nothing behind when a later step fails."""
    out = Path(options.out)
    options.check()
    langs = options.src, options.tgt
    prefixes = {"train": str(options.train), "valid": str(options.valid)}
    prefixes.update({("test" if i == 0 else f"test{i}"): str(p) for i, p in enumerate(options.test)})
    splits = [SplitFiles(name, p, find_pair(p, langs)) for name, p in prefixes.items()]
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

    with staged(out, options.force) as tmp:
        vocab, spm_record = sentencepiece_models(options, given, splits[0], scans["train"], tmp)
        with Workers(processes, (str(vocab.models[0]), str(vocab.models[1]))) as workers:
            binarized = {s.name: binarize(s, scans[s.name], workers, settings, langs, tmp) for s in splits}
        if not binarized["train"].pairs:
            raise ConfigError(nothing_left(binarized["train"].counts, settings))
        if vocab.dictionaries is None:
            vocab.dictionaries = count_dictionaries(vocab, langs, tmp)
        dtype = id_dtype(max(len(d) for d in vocab.dictionaries)).name
        for lang, dictionary in zip(langs, vocab.dictionaries, strict=True):
            dictionary.save(tmp / dictionary_file(lang))
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
                    "read_from": [str(path.resolve()) for path in s.files],  # a shipped file names the install
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
