"""Translate a prepared split with a pipeline checkpoint and score it as the papers do.

    python scripts/generate.py --checkpoint SAVE_DIR [--tag TAG] --data DIR --subset test \\
        [--beam 4] [--lenpen 1.0] [--batch-size 64] [--output FILE]

The checkpoint (any depth, any stage count) loads into the single-process model and decodes the split
in fairseq-generate's batches (corpus/batches.py's fairseq_batches), whose longest source sets each
batch's output limit: the hypotheses are fairseq-generate's on the exported model given the same
--beam, --lenpen, --max-len-a, --max-len-b and --batch-size. Hypotheses are detokenized with the data's
SentencePiece model and scored against the split's raw references: tokenized BLEU as the WMT papers
report it (multi-bleu.perl on Moses-tokenized text, German compounds split), then sacreBLEU's BLEU and
chrF (cased, detokenized, 13a) (translation/scoring.py). The last line printed is sacreBLEU's signature.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

from fathom.common.cli import command_parser
from fathom.common.errors import exit_on_config_error
from fathom.common.files import write_atomic
from fathom.common.heap import keep_freed_blocks
from fathom.common.outputs import check_writable_file
from fathom.corpus.batches import fairseq_batches
from fathom.corpus.dataset import BinarizedCorpus
from fathom.corpus.text import read_lines
from fathom.model.search import SearchConfig
from fathom.translation.decoding_flags import add_model_args, search_config
from fathom.translation.scoring import print_scores
from fathom.translation.translator import Translator


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    add_model_args(parser)
    parser.add_argument("--subset", default="test")
    parser.add_argument("--output", default=None, help="hypotheses file (default: SAVE_DIR/generate-SUBSET.txt)")
    return parser.parse_args(argv)


def split_batches(corpus: BinarizedCorpus, count: int, size: int) -> list[list[int]]:
    """The batches fairseq-generate decodes the split's first `count` pairs in with --batch-size `size`
    (its translation task shuffles every split but the one named test before sorting by length)."""
    lengths = (corpus.sources.lengths[:count], corpus.targets.lengths[:count])
    return fairseq_batches(*lengths, size, shuffled=corpus.split != "test")


class Translated(NamedTuple):
    hypotheses: list[str]  # detokenized, in the split's order
    references: list[str]  # the split's raw target lines
    lang: str  # the target language
    seconds: float  # the search's time


def translate_split(
    run_dir: str | Path,
    data: str | Path,
    subset: str = "test",
    tag: str | None = None,
    device: str | None = None,
    precision: str = "fp32",
    search: SearchConfig | None = None,
    output: Path | None = None,
) -> Translated:
    """A prepared split translated with the run's checkpoint (Translator.from_checkpoint's arguments) in
    fairseq-generate's batches. The split and the checkpoint are checked first, then that `output` (where
    the caller will write the hypotheses) can be written, then the search runs."""
    corpus = BinarizedCorpus(data, subset)
    translator = Translator.from_checkpoint(run_dir, data, tag, device, precision, search)
    if output is not None:
        check_writable_file(output, "--output", {"the references": corpus.references()})
    sources = [corpus.sources[i] for i in range(len(corpus))]
    tick = time.perf_counter()
    batches = split_batches(corpus, len(corpus), translator.search_cfg.batch_size)
    found = translator.search(sources, batches, f"translating {subset}")
    seconds = time.perf_counter() - tick
    hypotheses = [translator.detokenize(h) for h in found]
    return Translated(hypotheses, read_lines(corpus.references()), translator.data.tgt, seconds)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keep_freed_blocks()
    output = Path(args.output or Path(args.checkpoint) / f"generate-{args.subset}.txt")
    with exit_on_config_error():
        hypotheses, references, lang, seconds = translate_split(
            args.checkpoint, args.data, args.subset, args.tag, args.device, args.precision, search_config(args), output
        )
        write_atomic(output, "".join(h + "\n" for h in hypotheses))
    print(f"wrote {len(hypotheses)} hypotheses to {output}; decoding took {seconds:.1f} s")
    print_scores(hypotheses, references, lang, sys.stdout)
