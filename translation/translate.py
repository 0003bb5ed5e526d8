"""Translate raw text with a trained run: SentencePiece in, beam search, SentencePiece out.

    python scripts/translate.py --checkpoint SAVE_DIR [--tag TAG] --data DIR [--input FILE] [--output FILE] \\
        [--beam 4] [--lenpen 1.0] [--max-len-a 1.2] [--max-len-b 10] [--batch-size 64] [--reference FILE]

One sentence a line, from --input or stdin, to --output or stdout, in input order. The checkpoint
(any depth, any stage count) loads into the single-process model on the GPU if there is one
(--device, --precision); sentences are batched by length. A line that shows nothing (empty, blanks,
zero-width characters) gives an empty line; a line longer than the model's positions is cut to fit,
with one warning line naming it. With
--reference, the scores follow on stderr: tokenized BLEU as the WMT papers report it, then sacreBLEU's
BLEU and chrF, its signature last (translation/scoring.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.files import write_atomic
from fathom.common.heap import keep_freed_blocks
from fathom.common.outputs import check_writable_file
from fathom.corpus.text import decode_lines, read_lines
from fathom.translation.decoding_flags import add_model_args, command_line_translator, search_config
from fathom.translation.scoring import print_scores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    add_model_args(parser)
    parser.add_argument("--input", default=None, help="one sentence a line (default: stdin)")
    parser.add_argument("--output", default=None, help="translations, one a line (default: stdout)")
    parser.add_argument("--reference", default=None, help="reference translations: print BLEU and chrF on stderr")
    return parser.parse_args(argv)


def read_input(path: str | None) -> list[str]:
    if path is None:
        lines = decode_lines(sys.stdin.buffer, "stdin")
    elif not Path(path).is_file():
        raise ConfigError(f"--input {path}: no such file")
    else:
        lines = read_lines(Path(path))
    if not lines:
        raise ConfigError(f"{path or 'stdin'}: no lines to translate; pass a file with one sentence a line")
    return lines


def read_references(path: str, count: int) -> list[str]:
    if not Path(path).is_file():
        raise ConfigError(f"--reference {path}: no such file")
    references = read_lines(Path(path))
    if len(references) != count:
        raise ConfigError(f"--reference {path}: {len(references)} lines for {count} input lines; pass the aligned file")
    return references


def write_stdout(text: str) -> None:
    """A full disk or a closed pipe is reported here, naming stdout, not by the interpreter at exit."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as err:
        raise OSError(err.errno, err.strerror, "stdout") from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keep_freed_blocks()
    with exit_on_config_error():
        search_cfg = search_config(args)  # before reading the input, which may be a large file or stdin
        lines = read_input(args.input)
        if args.output:
            check_writable_file(Path(args.output), "--output", {"--input": args.input, "--reference": args.reference})
        references = read_references(args.reference, len(lines)) if args.reference else None
        translator = command_line_translator(args, search_cfg)
        translations = translator.translate(lines, progress=None if args.input is None else "translating")
        text = "".join(line + "\n" for line in translations)
        if args.output:
            write_atomic(Path(args.output), text)
        else:
            write_stdout(text)
    if references is not None:
        print_scores(translations, references, translator.data.tgt, sys.stderr)
