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
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import sentencepiece as spm
import torch
from tqdm import tqdm

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.files import write_atomic
from fathom.common.heap import keep_freed_blocks
from fathom.common.machine import native_bf16_cpu
from fathom.common.outputs import check_writable_file
from fathom.common.sections import check_field, check_fields
from fathom.corpus.batches import length_batches, with_eos
from fathom.corpus.dataset import PreparedData, check_vocab
from fathom.corpus.text import blank, decode_lines, read_lines
from fathom.model.model_config import DTYPES
from fathom.model.search import Hypothesis, SearchConfig, beam_search
from fathom.model.trained import load_reference
from fathom.model.transformer import Transformer
from fathom.translation.scoring import print_scores

SearchFn = Callable[[Transformer, torch.Tensor, SearchConfig], list[Hypothesis]]


def option_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_search_args(parser: argparse.ArgumentParser) -> None:
    """One flag per SearchConfig field: --max-len-a for max_len_a, of the default's type, with the field's
    default and its metadata "help"."""
    for setting in dataclasses.fields(SearchConfig):
        parser.add_argument(
            option_name(setting.name),
            type=type(setting.default),
            default=setting.default,
            help=setting.metadata.get("help"),
        )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The options that choose a checkpoint, its data directory, the device and the search."""
    parser.add_argument("--checkpoint", required=True, help="train.save_dir of a run")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. best or global_step4000 (default: latest)")
    parser.add_argument("--data", required=True, help="the run's data directory (scripts/prepare_data.py)")
    add_search_args(parser)
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if there is one)")
    parser.add_argument("--precision", choices=DTYPES, default="fp32", help="of the weights (log-probs in fp32)")


def search_config(args: argparse.Namespace) -> SearchConfig:
    """The search settings of a command line, each checked against its field's bounds under its flag."""
    for setting in dataclasses.fields(SearchConfig):
        check_field(setting, getattr(args, setting.name), option_name(setting.name))
    return SearchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SearchConfig)})


def device_and_dtype(device: str | None, precision: str) -> tuple[torch.device, torch.dtype]:
    """Where and in what precision to decode; fails in one line where the device cannot."""
    try:
        where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ConfigError(f"--device {device}: not a device; use cpu, cuda or cuda:N") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device here; use --device cpu")
    if where.type == "cpu" and precision == "fp16":
        raise ConfigError("--precision fp16: needs a GPU; on CPU use bf16 (where the CPU has avx512_bf16) or fp32")
    if where.type == "cpu" and precision == "bf16" and not native_bf16_cpu():
        print("fathom: warning: this CPU has no avx512_bf16 or amx_bf16: bf16 runs emulated, far slower than fp32",
              file=sys.stderr)  # fmt: skip
    return where, DTYPES[precision]


class Translator:
    """A trained model on a device, with its data's dictionaries and SentencePiece models, decoding with
    `search_cfg`. From Python:

        translator = Translator.from_checkpoint("checkpoints/my_pair", "data-bin/my_pair", tag="best")
        translator.translate(["Ein Hund rennt über die Wiese."])
    """

    def __init__(self, model: Transformer, data: PreparedData, search_cfg: SearchConfig):
        self.model, self.data, self.search_cfg = model, data, search_cfg
        self.tokenizer, self.detokenizer = (
            spm.SentencePieceProcessor(model_file=str(data.sentencepiece_model(lang))) for lang in (data.src, data.tgt)
        )

    @classmethod
    def from_checkpoint(
        cls,
        run_dir: str | Path,
        data: str | Path,
        tag: str | None = None,
        device: str | None = None,
        precision: str = "fp32",
        search: SearchConfig | None = None,
    ) -> Translator:
        """The run's checkpoint `tag` (default: latest; any depth, any stage count) in the single-process
        model, on `device` (default: cuda if there is one) in `precision` (fp32, bf16, fp16), with the
        prepared data directory `data` it was trained on. Fails in one ConfigError line where the search
        settings, the device, the data or the checkpoint cannot be used."""
        search = SearchConfig() if search is None else search
        check_fields(search, "search")
        where, dtype = device_and_dtype(device, precision)
        prepared = PreparedData(data)
        model = load_reference(run_dir, tag).to(where, dtype)
        check_vocab(run_dir, model.cfg, prepared)
        return cls(model, prepared, search)

    def translate(self, lines: list[str], progress: str | None = None) -> list[str]:
        """Translations of `lines` in their order, decoded in batches of similar source lengths; a line
        that shows nothing (corpus.text.blank) gives an empty line and is not decoded; with `progress`, a
        progress bar of that name on stderr."""
        sources = self.encode(lines)
        todo = [i for i, line in enumerate(lines) if not blank(line)]
        found = self.search(sources, length_batches(sources, todo, self.search_cfg.batch_size), progress)
        return ["" if hypothesis is None else self.detokenize(hypothesis) for hypothesis in found]

    def encode(self, lines: list[str]) -> list[torch.Tensor]:
        """Source token ids of each line; a line over the model's positions is cut to fit."""
        room = self.model.cfg.max_positions - 1  # and the eos
        sources = []
        for lineno, pieces in enumerate(self.tokenizer.encode(lines, out_type=str), 1):
            if len(pieces) > room:
                print(
                    f"fathom: warning: line {lineno}: {len(pieces)} pieces, cut to the model's {room} "
                    f"(model.max_positions {room + 1})",
                    file=sys.stderr,
                )
                pieces = pieces[:room]
            sources.append(torch.tensor(self.data.src_dict.encode(pieces), dtype=torch.long))
        return sources

    def search(
        self,
        sources: list[torch.Tensor],
        batches: list[list[int]],
        progress: str | None = None,
        search: SearchFn = beam_search,
    ) -> list[Hypothesis | None]:
        """Best hypothesis per source (token ids without eos), decoded in `batches` (lists of indices into
        `sources`), in input order, None for a source in no batch; `search` (model.search.beam_search's
        signature) lets a benchmark time another search on the same batches."""
        hypotheses: list[Hypothesis | None] = [None] * len(sources)
        for batch in tqdm(batches, desc=progress, unit="batch", file=sys.stderr, disable=progress is None):
            found = search(self.model, with_eos([sources[i] for i in batch]), self.search_cfg)
            for index, hypothesis in zip(batch, found, strict=True):
                hypotheses[index] = hypothesis
        return hypotheses

    def detokenize(self, hypothesis: Hypothesis) -> str:
        return self.data.target_text(hypothesis.tokens, self.detokenizer)


def command_line_translator(args: argparse.Namespace, search_cfg: SearchConfig) -> Translator:
    """The Translator add_model_args' options choose, with `search_cfg` (search_config(args), checked)."""
    return Translator.from_checkpoint(args.checkpoint, args.data, args.tag, args.device, args.precision, search_cfg)


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
