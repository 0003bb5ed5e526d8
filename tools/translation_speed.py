"""Translation speed side by side: fathom's incremental beam search, its first search (which recomputed
the whole decoder over the whole prefix at every position), and fairseq 0.12.2's fairseq-generate on the
exported model, each decoding the same prepared split.

    python scripts/bench_translate.py --checkpoint SAVE_DIR [--tag TAG] --data DIR [--subset test] \\
        [--beam 4] [--lenpen 0.6] [--batch-size 64] [--systems incremental,full,fairseq] [--rounds 1] \\
        [--threads 2] [--json FILE]

Every system gets the same beam, length penalty, length limits, sentences per batch, threads and heap
settings (common/heap.py), and the systems take turns round by round, so a noisy machine slows them
alike. Times are of decoding alone: model loading and start-up are excluded (for fairseq, its own
"Translated ... in S s"). The hypotheses of each system are compared with the incremental search's,
sentence by sentence after SentencePiece decoding. The full-recompute search is
model/full_recompute_search.py, the incremental search's specification; fairseq needs
`bash scripts/setup_fairseq_env.sh`.

    python scripts/bench_translate.py depth [--depths 25,50,100] [--dim 128] [--length 30]

times the searches against decoder depth instead, on randomly initialized models (depth_main).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, check_counts, check_number, exit_on_config_error, int_list
from fathom.common.files import write_atomic
from fathom.common.heap import decoding_env, keep_freed_blocks
from fathom.common.outputs import check_writable_file
from fathom.common.tables import markdown_row, markdown_rule, markdown_table
from fathom.convert.to_fairseq import export
from fathom.corpus.dataset import BinarizedCorpus
from fathom.model.full_recompute_search import full_recompute_search
from fathom.model.model_config import NUM_SPECIAL, ModelConfig
from fathom.model.search import SearchConfig, beam_search
from fathom.translation.decoding_flags import add_model_args, command_line_translator, option_name, search_config
from fathom.translation.generate import split_batches
from fathom.translation.translator import SearchFn, Translator

SYSTEMS = ("incremental", "full", "fairseq")
FAIRSEQ_ENV = Path(os.environ.get("FATHOM_FAIRSEQ_ENV", Path.home() / ".cache" / "fathom" / "fairseq-0.12.2"))
TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    add_model_args(parser)
    parser.add_argument("--subset", default="test")
    parser.add_argument("--sentences", type=int, default=0, help="the split's first N sentences only (0: all)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--rounds", type=int, default=1, help="each system decodes the split this many times")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads of every system")
    parser.add_argument("--fairseq-env", default=str(FAIRSEQ_ENV), help="from scripts/setup_fairseq_env.sh")
    parser.add_argument("--json", default=None, help="write the results here too")
    return parser.parse_args(argv)


class Fathom:
    """A search of ours, in this process."""

    def __init__(
        self, translator: Translator, sources: list[torch.Tensor], batches: list[list[int]], search: SearchFn | None
    ):
        self.translator, self.sources, self.batches = translator, sources, batches
        self.options = {} if search is None else {"search": search}

    def __call__(self) -> tuple[float, list[str]]:
        tick = time.perf_counter()
        found = self.translator.search(self.sources, self.batches, **self.options)
        seconds = time.perf_counter() - tick
        return seconds, [self.translator.detokenize(h) for h in found]


def search_flags(cfg: SearchConfig) -> list[str]:
    """fairseq-generate's flags for the same search: fathom's search flags are fairseq's (add_search_args)."""
    return [text for setting in fields(cfg) for text in (option_name(setting.name), str(getattr(cfg, setting.name)))]


class Fairseq:
    """fairseq-generate on the model exported to fairseq, in its own environment and process."""

    def __init__(self, args: argparse.Namespace, translator: Translator, workdir: Path, sentences: int):
        bin_dir = Path(args.fairseq_env) / "bin"
        if not (bin_dir / "fairseq-generate").exists():
            raise ConfigError(
                f"--fairseq-env {args.fairseq_env}: no fairseq-generate; run bash scripts/setup_fairseq_env.sh"
            )
        self.export = workdir / "fairseq"
        export(args.checkpoint, args.data, self.export, args.tag, splits=[args.subset])
        self.sentences = sentences
        for split_file in self.export.glob(f"{args.subset}.*-*.*"):  # fairseq raw text: keep the first sentences
            lines = split_file.read_text(encoding="utf-8").split("\n")[:sentences]
            split_file.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        self.command = [
            str(bin_dir / "fairseq-generate"), str(self.export), "--path", str(self.export / "checkpoint.pt"),
            "--dataset-impl", "raw", "--gen-subset", args.subset, "--cpu", *search_flags(translator.search_cfg),
        ]  # fmt: skip
        # the same threads and heap settings as ours
        threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        self.env = {**os.environ, **threads, **decoding_env()}
        self.detokenizer = translator.detokenizer

    def __call__(self) -> tuple[float, list[str]]:
        result = subprocess.run(self.command, env=self.env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"fairseq-generate failed:\n{result.stderr[-3000:]}")
        hypotheses = {}
        for line in result.stdout.split("\n"):  # a hypothesis may hold U+2028
            if line.startswith("H-"):
                index, _, pieces = line.split("\t")
                hypotheses[int(index[2:])] = self.detokenizer.decode_pieces(pieces.split(" "))
        seconds = float(TRANSLATED.search(result.stdout + result.stderr)[3])
        return seconds, [hypotheses[i] for i in range(self.sentences)]


def run(args: argparse.Namespace) -> dict:
    systems = args.systems.split(",")
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise ConfigError(f"--systems: unknown system '{unknown[0]}'; choose from {', '.join(SYSTEMS)}")
    search_cfg = search_config(args)
    check_number("--sentences", args.sentences, 0, what=" (0: the whole split)")
    check_number("--rounds", args.rounds, 1)
    check_number("--threads", args.threads, 1)
    if args.json:
        check_writable_file(Path(args.json), "--json")
    torch.set_num_threads(args.threads)
    corpus = BinarizedCorpus(args.data, args.subset)
    translator = command_line_translator(args, search_cfg)
    sources = [corpus.sources[i] for i in range(min(args.sentences or len(corpus), len(corpus)))]
    batches = split_batches(corpus, len(sources), search_cfg.batch_size)  # fairseq-generate's
    with tempfile.TemporaryDirectory() as workdir:
        runners = {
            "incremental": lambda: Fathom(translator, sources, batches, None),
            "full": lambda: Fathom(translator, sources, batches, full_recompute_search),
            "fairseq": lambda: Fairseq(args, translator, Path(workdir), len(sources)),
        }
        bench = {name: runners[name]() for name in systems}
        seconds: dict[str, list[float]] = {name: [] for name in systems}
        hypotheses: dict[str, list[str]] = {}
        for round_ in range(args.rounds):
            for name, decode in bench.items():
                took, hypotheses[name] = decode()
                seconds[name].append(took)
                print(f"round {round_ + 1}: {name} {took:.1f} s", file=sys.stderr, flush=True)
    incremental = hypotheses.get("incremental")
    return {
        "sentences": len(sources),
        "threads": args.threads,
        "search": asdict(search_cfg),
        "systems": {
            name: {
                "seconds": times,
                "median_seconds": statistics.median(times),
                "same_as_incremental": None
                if incremental is None
                else sum(a == b for a, b in zip(hypotheses[name], incremental, strict=True)),
            }
            for name, times in seconds.items()
        },
    }


def table(results: dict) -> str:
    systems = results["systems"]
    base = systems.get("incremental", next(iter(systems.values())))["median_seconds"]
    rows = []
    for name, r in systems.items():
        same = "" if r["same_as_incremental"] is None else f"{r['same_as_incremental']} / {results['sentences']}"
        speed = results["sentences"] / r["median_seconds"]
        rows.append((name, f"{r['median_seconds']:.1f}", f"{speed:.1f}", f"{r['median_seconds'] / base:.2f}x", same))
    header = ("system", "seconds (median)", "sentences/s", "incremental is faster by", "same hypotheses as incremental")
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["depth"]:
        depth_main(argv[1:])
        return
    args = parse_args(argv)
    keep_freed_blocks()
    with exit_on_config_error():
        results = run(args)
    print(table(results))
    if args.json:
        write_atomic(Path(args.json), json.dumps(results, indent=2) + "\n")


def parse_depth_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(inspect.cleandoc(depth_main.__doc__))  # raw help: without the indent
    parser.add_argument("--depths", type=int_list, default=(25, 50, 100), help="decoder depths, comma-separated")
    parser.add_argument("--encoder-layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--sentences", type=int, default=64, help="source sentences, one batch")
    parser.add_argument("--length", type=int, default=30, help="tokens every hypothesis gets (eos after exactly this)")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--systems", default="incremental,full", help="incremental, full or both")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    return parser.parse_args(argv)


DEPTH_HEADS = 4  # attention heads of depth_main's models


def check_depth_args(args: argparse.Namespace) -> list[str]:
    """The searches to time; every refusal comes before any model is built."""
    systems = args.systems.split(",")
    if unknown := [s for s in systems if s not in ("incremental", "full")]:
        raise ConfigError(f"--systems: unknown search '{unknown[0]}'; choose from incremental, full")
    for depth in args.depths:
        check_number("--depths", depth, 1)
    check_counts({"--encoder-layers": args.encoder_layers, "--sentences": args.sentences, "--beam": args.beam,
                  "--threads": args.threads})  # fmt: skip
    check_number("--dim", args.dim, DEPTH_HEADS, what=" (one per head)")
    if args.dim % DEPTH_HEADS:
        raise ConfigError(f"--dim: {args.dim} is not divisible by the {DEPTH_HEADS} heads; pick a multiple")
    check_number("--vocab", args.vocab, NUM_SPECIAL + 1, what=f" ({NUM_SPECIAL} special symbols and a word)")
    # every hypothesis is forced to --length tokens, and the search stops one short of the positions
    room = ModelConfig().max_positions - 1
    check_number("--length", args.length, 1, room, what=" (model.max_positions - 1)")
    return systems


def depth_main(argv: list[str] | None = None) -> None:
    """Decoding time against decoder depth: randomly initialized models of one width, one batch of 15-token
    sources, every hypothesis forced to the same length (eos forbidden before it, the only choice after), so
    only the depth changes; the incremental search should grow linearly with depth.

        python scripts/bench_translate.py depth [--depths 25,50,100] [--dim 128] [--length 30] [--sentences 64]
    """
    from fathom.model import Transformer

    args = parse_depth_args(argv)
    with exit_on_config_error():
        systems = check_depth_args(args)
    keep_freed_blocks()
    torch.set_num_threads(args.threads)
    searches = {"incremental": beam_search, "full": full_recompute_search}
    search_cfg = SearchConfig(beam=args.beam, max_len_a=0, max_len_b=args.length)
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, args.vocab, (args.sentences, 15), generator=generator)
    src[:, -1] = 2  # eos
    header = ["decoder layers", *(f"{s} seconds" for s in systems), "incremental seconds per layer"]
    print(markdown_row(header))
    print(markdown_rule(len(header)))
    for depth in args.depths:
        torch.manual_seed(0)
        cfg = ModelConfig(
            encoder_layers=args.encoder_layers, decoder_layers=depth, embed_dim=args.dim, ffn_dim=4 * args.dim,
            attention_heads=DEPTH_HEADS, dropout=0.0, src_vocab_size=args.vocab, tgt_vocab_size=args.vocab,
        )  # fmt: skip
        model = Transformer(cfg).eval()
        times = {}
        for name in systems:
            tick = time.perf_counter()
            found = searches[name](model, src, search_cfg, min_len=args.length)
            times[name] = time.perf_counter() - tick
            assert all(len(h.tokens) == args.length for h in found)
        per_layer = f"{times['incremental'] / depth:.3f}" if "incremental" in times else ""
        print(markdown_row([depth, *(f"{times[s]:.1f}" for s in systems), per_layer]), flush=True)
