"""Raw parallel text -> SentencePiece model, fairseq dictionaries and a binarized, memory-mapped dataset.

    python scripts/prepare_data.py --src de --tgt en --train PREFIX --valid PREFIX [--test PREFIX ...] \\
        --vocab-size V --out DIR

PREFIX.de and PREFIX.en are raw text, plain or .gz, one sentence per line. Everything is written to
a temporary directory beside DIR and renamed into place only when complete, so a failure never
leaves a half-written DIR.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from corpus.prepared import META_FILE, Dictionary, file_record, write_indexed
from model.config import ConfigError, exit_on_config_error
from pipeline.staging import check_output_dir, staged


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, help="source language suffix, e.g. de")
    parser.add_argument("--tgt", required=True, help="target language suffix, e.g. en")
    parser.add_argument("--train", required=True, metavar="PREFIX")
    parser.add_argument("--valid", required=True, metavar="PREFIX")
    parser.add_argument("--test", nargs="*", default=[], metavar="PREFIX", help="splits test, test1, test2, ...")
    parser.add_argument("--vocab-size", type=int, required=True, help="SentencePiece vocabulary size")
    parser.add_argument("--separate-vocab", action="store_true", help="one SentencePiece model per language")
    parser.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    parser.add_argument("--max-len", type=int, default=256, help="drop training pairs longer (in pieces)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser.parse_args(argv)


def find_file(prefix: str, lang: str) -> Path:
    for candidate in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{prefix}.{lang}: no such file (also tried {prefix}.{lang}.gz)")


def decode_lines(f: BinaryIO, name: str | Path) -> list[str]:
    """Lines of a binary stream as UTF-8 text, split on newlines only (str.splitlines would also split on
    U+2028, form feeds, ..., and misalign the sides); bytes that are not UTF-8 are an error naming the line."""
    lines = []
    for lineno, raw in enumerate(f, 1):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{name}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start}); re-encode the file as UTF-8"
            ) from None
    return lines


def read_lines(path: Path) -> list[str]:
    """Lines of a plain or gzipped UTF-8 file (decode_lines)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()  # whole first: gzip's checksum is only checked at the end of the stream
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:  # cut short, not gzip, or damaged inside
        raise ConfigError(f"{path}: not a whole gzip file ({err}); download or compress it again") from None
    return decode_lines(io.BytesIO(data), path)


@dataclass
class Split:
    name: str
    src: list[str]
    tgt: list[str]
    dropped_empty: int = 0
    dropped_long: int = 0
    ids: dict[str, list[list[int]]] = field(default_factory=dict)


def read_split(name: str, prefix: str, src: str, tgt: str) -> Split:
    src_path, tgt_path = find_file(prefix, src), find_file(prefix, tgt)
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise ConfigError(
            f"{src_path} has {len(src_lines)} lines but {tgt_path} has {len(tgt_lines)}; the sides must be line-aligned"
        )
    keep = [i for i, (s, t) in enumerate(zip(src_lines, tgt_lines, strict=True)) if s.strip() and t.strip()]
    if not keep:
        raise ConfigError(f"{prefix}: no pair with text on both sides")
    return Split(
        name, [src_lines[i] for i in keep], [tgt_lines[i] for i in keep], dropped_empty=len(src_lines) - len(keep)
    )


def train_sentencepiece(lines: list[str], prefix: Path, vocab_size: int, model_type: str) -> spm.SentencePieceProcessor:
    # Our dictionary adds <s>, <pad>, </s> itself; SentencePiece keeps only its <unk> (id 0).
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        bos_id=-1,
        eos_id=-1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def encode(processor: spm.SentencePieceProcessor, lines: list[str], desc: str) -> list[list[str]]:
    batch = 2000
    pieces: list[list[str]] = []
    for start in tqdm(range(0, len(lines), batch), desc=desc, unit_scale=batch, unit="lines", leave=False):
        pieces.extend(processor.encode(lines[start : start + batch], out_type=str))
    return pieces


HELD_OUT_WARNING = 0.01  # Multi30k's valid and test splits each share 1 pair of ~1,000 with train


def check_held_out(splits: list[Split], prefixes: dict[str, str]) -> None:
    """Validation and test pairs that are also training pairs measure memory, not translation: a split
    made only of them (the train prefix given again) is refused, and more than 1% is a warning."""
    train = set(zip(splits[0].src, splits[0].tgt, strict=True))
    for split in splits[1:]:
        seen = sum(pair in train for pair in zip(split.src, split.tgt, strict=True))
        where = f"{split.name} ({prefixes[split.name]})"
        if seen == len(split.src):
            raise ConfigError(f"{where}: every pair is also a training pair; give held-out data")
        if seen > HELD_OUT_WARNING * len(split.src):
            print(f"fathom: warning: {where}: {seen} of {len(split.src)} pairs are training pairs too", file=sys.stderr)


def prepare(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    if args.src == args.tgt:
        raise ConfigError(f"--src and --tgt are both '{args.src}'; the two sides need different suffixes")
    prefixes = {"train": args.train, "valid": args.valid}
    prefixes.update({("test" if i == 0 else f"test{i}"): p for i, p in enumerate(args.test)})
    # the files themselves too: a prefix's file may be a link into --out
    files = [find_file(prefix, lang) for prefix in prefixes.values() for lang in (args.src, args.tgt)]
    check_output_dir(out, args.force, META_FILE, [*prefixes.values(), *files])
    if args.vocab_size < 8:
        raise ConfigError(f"--vocab-size: {args.vocab_size} is too small; use at least 8")
    if args.max_len < 1:
        raise ConfigError(f"--max-len: must be at least 1 piece, got {args.max_len}")
    splits = [read_split(name, prefix, args.src, args.tgt) for name, prefix in prefixes.items()]
    check_held_out(splits, prefixes)
    train = splits[0]

    with staged(out) as tmp:
        print(f"training SentencePiece ({args.model_type}, {args.vocab_size} pieces) on {len(train.src)} pairs")
        try:
            if args.separate_vocab:
                processors = {
                    args.src: train_sentencepiece(train.src, tmp / f"spm.{args.src}", args.vocab_size, args.model_type),
                    args.tgt: train_sentencepiece(train.tgt, tmp / f"spm.{args.tgt}", args.vocab_size, args.model_type),
                }
            else:
                joint = train_sentencepiece(train.src + train.tgt, tmp / "spm", args.vocab_size, args.model_type)
                processors = {args.src: joint, args.tgt: joint}
        except RuntimeError as err:
            reason = str(err).splitlines()[-1]
            # Its other failure here is a model file it could not write whole and so cannot read back.
            fix = "try a smaller --vocab-size" if "vocab" in reason.lower() else f"is {out.parent} full?"
            raise ConfigError(f"SentencePiece: {reason}; {fix}") from None

        pieces = {
            (split.name, lang): encode(processors[lang], getattr(split, side), f"{split.name}.{lang}")
            for split in splits
            for side, lang in (("src", args.src), ("tgt", args.tgt))
        }
        # Training pairs over --max-len pieces are dropped; valid and test keep every line so scores
        # stay comparable with other systems.
        long = [
            i
            for i, (s, t) in enumerate(zip(pieces["train", args.src], pieces["train", args.tgt], strict=True))
            if len(s) > args.max_len or len(t) > args.max_len
        ]
        if long:
            drop = set(long)
            for lang, side in ((args.src, "src"), (args.tgt, "tgt")):
                pieces["train", lang] = [p for i, p in enumerate(pieces["train", lang]) if i not in drop]
                setattr(train, side, [x for i, x in enumerate(getattr(train, side)) if i not in drop])
            train.dropped_long = len(long)
        if not train.src:
            raise ConfigError(
                f"train: no pairs left ({len(long)} over --max-len {args.max_len} dropped); raise --max-len"
            )

        counts = {lang: Counter() for lang in (args.src, args.tgt)}
        for lang in counts:
            for sentence in pieces["train", lang]:
                counts[lang].update(sentence)
        if not args.separate_vocab:
            merged = counts[args.src] + counts[args.tgt]
            counts = {args.src: merged, args.tgt: merged}
        dictionaries = {lang: Dictionary.from_counts(c) for lang, c in counts.items()}
        dtype = "uint16" if max(len(d) for d in dictionaries.values()) < 2**16 else "int32"
        for lang, dictionary in dictionaries.items():
            dictionary.save(tmp / f"dict.{lang}.txt")

        for split in splits:
            for side, lang in (("src", args.src), ("tgt", args.tgt)):
                ids = [dictionaries[lang].encode(p) for p in pieces[split.name, lang]]
                write_indexed(tmp / f"{split.name}.{lang}", ids, np.dtype(dtype))
                raw = "".join(x + "\n" for x in getattr(split, side))
                (tmp / f"{split.name}.raw.{lang}").write_text(raw, encoding="utf-8")

        meta = {
            "src": args.src,
            "tgt": args.tgt,
            "joint_vocab": not args.separate_vocab,
            "dtype": dtype,
            "vocab": {lang: len(d) for lang, d in dictionaries.items()},
            "splits": {
                s.name: {
                    "pairs": len(s.src),
                    "dropped_empty": s.dropped_empty,
                    "dropped_too_long": s.dropped_long,
                    "source": prefixes[s.name],
                }
                for s in splits
            },
            "files": {f.name: file_record(f) for f in sorted(tmp.iterdir())},
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        meta = prepare(args)
    for name, split in meta["splits"].items():
        print(
            f"{name}: {split['pairs']} pairs ({split['dropped_empty']} empty dropped, "
            f"{split['dropped_too_long']} over --max-len dropped)"
        )
    print(f"dictionaries: {meta['vocab']} entries; written to {args.out}")
