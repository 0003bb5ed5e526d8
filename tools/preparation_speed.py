"""Data preparation side by side: fathom's scripts/prepare_data.py against the pipeline fairseq users run
(SentencePiece's trainer, spm_encode, fairseq-preprocess from fairseq 0.12.2), on the same stand-in corpus.

    python scripts/bench_prepare.py --pairs N --work DIR [--vocab-size 8000] [--workers W] \\
        [--systems fathom,fairseq] [--spm-sample S] [--model-type unigram] [--json FILE] [--keep]

The corpus is WMT-sized sentences made of Multi30k's (tools/standin_corpus.py), N training pairs in
DIR/corpus/train.{de,en}, and Multi30k's val split as the valid split; it is kept and reused by later
runs with the same N. Both systems train SentencePiece with the same settings on a sample of S sentences
of both sides (fathom: its own seeded sample; fairseq: SentencePiece's input_sentence_size over the two
sides' files) and encode with W processes. fairseq's stages, each timed:

    spm train     spm.SentencePieceTrainer.train(input="train.de,train.en", input_sentence_size=S, ...)
    spm encode    each of train.{de,en}, valid.{de,en} to space-separated pieces, one process per file
                  as spm_encode runs, W at a time (xargs -P W), each on one thread
    preprocess    fairseq-preprocess --joined-dictionary --workers W --dataset-impl mmap

Measured per system and stage: wall time, pairs/s (training pairs / wall time), and peak memory of the
whole process tree, sampled every 0.1 s: the sum of RSS over the process and all its descendants, and
the sum of PSS, which splits the pages forked workers share instead of counting them once per worker.
The corpus is read once before timing, so neither system pays for the disk. DIR holds only the
benchmark's files (a stamp marks it); the prepared outputs, GBs at WMT size, are deleted after they are
measured unless --keep. fairseq needs `bash scripts/setup_fairseq_env.sh`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.files import write_atomic
from fathom.common.machine import cpu
from fathom.common.outputs import check_makeable, check_writable_file
from fathom.common.run_layout import META_FILE
from fathom.common.tables import markdown_table
from fathom.corpus.data_layout import token_file
from fathom.corpus.prepare_options import SPM_SAMPLE
from fathom.corpus.subwords import TRAINING_THREADS
from fathom.corpus.text import read_lines
from fathom.tools.process_sampling import Measured, StageError, mib, run_sampled
from fathom.tools.standin_corpus import MULTI30K, write_standin
from fathom.tools.translation_speed import FAIRSEQ_ENV

SYSTEMS = ("fathom", "fairseq")
SRC, TGT = "de", "en"
SEED = 0  # of the stand-in corpus
WORK_STAMP = ".fathom-bench-prepare"  # marks a directory this benchmark made, and may write in
CORPUS_STAMP = "standin.json"
# The benchmark's own outputs under --work: removed before a run (a killed run may have left them) and,
# but for corpus and logs, after it unless --keep. ".fathom." and ".corpus." are staging directories.
OUTPUTS = ("fathom", "fairseq", "fairseq-work")
STAGING = (".fathom.", ".corpus.")
LOG_TAIL = 20  # lines of a failed stage's log shown

# fairseq's examples/translation scripts run spm_encode on each file; this is it on the pip package,
# streamed in batches, on one thread: the W processes xargs runs get W cores, as fathom's W workers do.
SPM_ENCODE = """\
import itertools, sys
import sentencepiece as spm
model, source, target = sys.argv[1:]
processor = spm.SentencePieceProcessor(model_file=model)
with open(source, encoding="utf-8", newline="\\n") as fin, open(target, "w", encoding="utf-8", newline="\\n") as fout:
    while lines := [line.rstrip("\\n") for line in itertools.islice(fin, 10000)]:
        fout.writelines(" ".join(p) + "\\n" for p in processor.encode(lines, out_type=str, num_threads=1))
"""
MMAP_MAGIC = b"MMIDIDX\x00\x00"  # fairseq's MMapIndexedDataset .idx header: magic, version <Q, dtype <B, len <Q


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument("--pairs", type=int, required=True, help="training pairs of the stand-in corpus")
    parser.add_argument("--work", type=Path, required=True, help="the benchmark's directory (made if new)")
    parser.add_argument("--vocab-size", type=int, default=8000, help="SentencePiece vocabulary size")
    parser.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes that encode")
    parser.add_argument(
        "--spm-sample", type=int, default=SPM_SAMPLE, metavar="S", help="sentences SentencePiece trains on"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--fairseq-env", type=Path, default=FAIRSEQ_ENV, help="from scripts/setup_fairseq_env.sh")
    parser.add_argument("--json", type=Path, default=None, help="write the results and commands here too")
    parser.add_argument("--keep", action="store_true", help="keep the prepared outputs (GBs at WMT size)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """The systems to run; every refusal comes before anything is written."""
    systems = args.systems.split(",")
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise ConfigError(f"--systems: unknown system '{unknown[0]}'; choose from {', '.join(SYSTEMS)}")
    if len(set(systems)) != len(systems):
        raise ConfigError(f"--systems: '{args.systems}' names a system twice")
    minimums = {
        "--pairs": (args.pairs, 1), "--workers": (args.workers, 1), "--spm-sample": (args.spm_sample, 1),
        "--vocab-size": (args.vocab_size, 8),
    }  # fmt: skip
    for option, (value, least) in minimums.items():
        if value < least:
            raise ConfigError(f"{option}: must be at least {least}, got {value}")
    if not all((MULTI30K / f"{split}.{lang}.gz").is_file() for split in ("train", "val") for lang in (SRC, TGT)):
        raise ConfigError(f"{MULTI30K}: Multi30k's train and val splits are missing; run from a fathom checkout")
    check_work(args.work)
    if args.json:
        check_writable_file(args.json, "--json")
        target = args.json.resolve()
        if any(args.work.resolve() / name in (target, *target.parents) for name in (*OUTPUTS, "corpus", "logs")):
            raise ConfigError(
                f"--json {args.json}: among the benchmark's own outputs, which it replaces; write it elsewhere"
            )
    # Last: whether fairseq's environment is built depends on the machine, not on these arguments, and an
    # argument's own error must read the same on a machine that never built it.
    if "fairseq" in systems:
        for tool in ("python", "fairseq-preprocess"):
            if not (args.fairseq_env / "bin" / tool).exists():
                raise ConfigError(
                    f"--fairseq-env {args.fairseq_env}: no bin/{tool}; run bash scripts/setup_fairseq_env.sh"
                )
    return systems


def check_work(work: Path) -> None:
    """--work is new, empty, or one this benchmark made: it deletes its outputs there, so never a
    directory of someone else's files."""
    check_makeable(work, "--work")
    if (work / META_FILE).exists():
        raise ConfigError(f"--work {work}: is a prepared data directory; choose a directory of its own")
    if work.is_dir() and any(work.iterdir()) and not (work / WORK_STAMP).is_file():
        raise ConfigError(
            f"--work {work}: holds files this benchmark did not write (no {WORK_STAMP}); choose a new directory"
        )


def remove_outputs(work: Path) -> None:
    for entry in work.iterdir():
        if entry.name in OUTPUTS or entry.name.startswith(STAGING):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def corpus_files(corpus: Path) -> list[Path]:
    return [corpus / f"{split}.{lang}" for split in ("train", "valid") for lang in (SRC, TGT)]


def build_corpus(corpus: Path, pairs: int) -> bool:
    """CORPUS/train.{de,en} (the stand-in, `pairs` lines) and valid.{de,en} (Multi30k's val split); an
    earlier one of the same size is reused. True if reused. Written beside it and renamed when whole."""
    stamp = corpus / CORPUS_STAMP
    wanted = {"pairs": pairs, "seed": SEED, "src": SRC, "tgt": TGT}
    if stamp.is_file():
        recorded = json.loads(stamp.read_text())
        sizes = {f.name: f.stat().st_size if f.is_file() else None for f in corpus_files(corpus)}
        if {k: recorded.get(k) for k in wanted} == wanted and recorded.get("bytes") == sizes:
            return True
    staging = corpus.parent / f".corpus.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_standin(staging / "train", pairs, SRC, TGT, seed=SEED)
    for lang in (SRC, TGT):
        lines = read_lines(MULTI30K / f"val.{lang}.gz")
        (staging / f"valid.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    sizes = {f.name: f.stat().st_size for f in corpus_files(staging)}
    (staging / CORPUS_STAMP).write_text(json.dumps({**wanted, "bytes": sizes}, indent=2) + "\n")
    if corpus.exists():
        shutil.rmtree(corpus)
    staging.rename(corpus)
    return False


def warm_page_cache(files: list[Path]) -> None:
    """Reads the corpus once, so that the first system timed does not pay for the disk alone."""
    for path in files:
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass


def fathom_stages(args: argparse.Namespace, corpus: Path) -> dict[str, Measured]:
    out = args.work / "fathom"
    command = [
        sys.executable, "scripts/prepare_data.py", "--src", SRC, "--tgt", TGT, "--train", str(corpus / "train"),
        "--valid", str(corpus / "valid"), "--vocab-size", str(args.vocab_size), "--model-type", args.model_type,
        "--spm-sample", str(args.spm_sample), "--workers", str(args.workers), "--out", str(out), "--force",
    ]  # fmt: skip
    return {"prepare_data.py": run_sampled("fathom: prepare_data.py", command, args.work / "logs" / "fathom.log")}


def fairseq_stages(args: argparse.Namespace, corpus: Path) -> dict[str, Measured]:
    env_bin = args.fairseq_env / "bin"
    work = args.work / "fairseq-work"
    work.mkdir(parents=True)
    logs = args.work / "logs"
    # the env's Python is 3.10 and imports fairseq: nothing of this Python's may leak into its path
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    stages = {}

    sides = ",".join(str(corpus / f"train.{lang}") for lang in (SRC, TGT))
    options = {
        "input": sides, "model_prefix": str(work / "fairseq_spm"), "vocab_size": args.vocab_size,
        "model_type": args.model_type, "character_coverage": 1.0, "bos_id": -1, "eos_id": -1,
        "num_threads": TRAINING_THREADS, "input_sentence_size": args.spm_sample, "shuffle_input_sentence": True,
    }  # fmt: skip  # fathom's settings (corpus/subwords.py train), SentencePiece's own sampling
    call = ", ".join(f"{k}={v!r}" for k, v in options.items())
    code = f"import sentencepiece as spm; spm.SentencePieceTrainer.train({call})"
    stages["spm train"] = run_sampled(
        "fairseq: spm train", [str(env_bin / "python"), "-c", code], logs / "fairseq-spm-train.log", env=env
    )

    # largest first, so that the training files run side by side when W >= 2
    files = [
        (corpus / f"{split}.{lang}", work / f"{split}.{lang}") for split in ("train", "valid") for lang in (SRC, TGT)
    ]
    jobs = work / "encode.jobs"
    jobs.write_bytes(b"".join(f"{source}\0{target}\0".encode() for source, target in files))
    command = ["xargs", "-0", "-a", str(jobs), "-n", "2", "-P", str(args.workers), str(env_bin / "python"), "-c",
               SPM_ENCODE, str(work / "fairseq_spm.model")]  # fmt: skip
    stages["spm encode"] = run_sampled("fairseq: spm encode", command, logs / "fairseq-spm-encode.log", env=env)

    command = [
        str(env_bin / "fairseq-preprocess"), "--source-lang", SRC, "--target-lang", TGT,
        "--trainpref", str(work / "train"), "--validpref", str(work / "valid"), "--destdir", str(args.work / "fairseq"),
        "--joined-dictionary", "--workers", str(args.workers), "--dataset-impl", "mmap",
    ]  # fmt: skip
    stages["preprocess"] = run_sampled("fairseq: fairseq-preprocess", command, logs / "fairseq-preprocess.log", env=env)
    return stages


def mmap_sentences(idx: Path) -> int | None:
    """Sentences in a fairseq mmap dataset, from its .idx header."""
    with idx.open("rb") as f:
        header = f.read(len(MMAP_MAGIC) + 17)
    if not header.startswith(MMAP_MAGIC) or len(header) < len(MMAP_MAGIC) + 17:
        return None
    return struct.unpack("<Q", header[len(MMAP_MAGIC) + 9 :])[0]


def outputs(system: str, work: Path) -> dict:
    """What a system wrote: training pairs per side (both must have every pair) and bytes on disk."""
    out = work / system
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    if system == "fathom":
        pairs = json.loads((out / META_FILE).read_text())["splits"]["train"]["pairs"]
        sides = {lang: pairs for lang in (SRC, TGT) if (out / token_file("train", lang)).stat().st_size}
    else:
        sides = {lang: mmap_sentences(out / f"train.{SRC}-{TGT}.{lang}.idx") for lang in (SRC, TGT)}
    return {"train_pairs": sides, "bytes": size}


@dataclass
class SystemResult:
    stages: dict[str, Measured]
    output: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(m.seconds for m in self.stages.values())

    @property
    def peak_rss(self) -> int:
        return max(m.peak_rss for m in self.stages.values())

    @property
    def peak_pss(self) -> int | None:
        values = [m.peak_pss for m in self.stages.values()]
        return None if None in values else max(values)


def run(args: argparse.Namespace) -> dict:
    systems = check_args(args)
    # the commands run from the repository root, not from here
    args.work, args.fairseq_env = args.work.absolute(), args.fairseq_env.absolute()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_STAMP).write_text("written by scripts/bench_prepare.py, which deletes its outputs here\n")
    remove_outputs(work)
    corpus = work / "corpus"
    tick = time.perf_counter()
    reused = build_corpus(corpus, args.pairs)
    corpus_seconds = time.perf_counter() - tick
    print(f"corpus: {args.pairs:,} pairs in {corpus} ({'reused' if reused else 'written'} in {corpus_seconds:.1f} s)",
          file=sys.stderr, flush=True)  # fmt: skip
    warm_page_cache(corpus_files(corpus))
    runners = {"fathom": fathom_stages, "fairseq": fairseq_stages}
    results: dict[str, SystemResult] = {}
    try:
        for name in systems:
            results[name] = SystemResult(runners[name](args, corpus))
            results[name].output = outputs(name, work)
            print(f"{name}: {results[name].seconds:.1f} s", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            remove_outputs(work)
    return {
        "pairs": args.pairs,
        "valid_pairs": len(read_lines(corpus / f"valid.{SRC}")),
        "corpus": {"path": str(corpus), "reused": reused, "seconds": corpus_seconds, "seed": SEED},
        "vocab_size": args.vocab_size,
        "model_type": args.model_type,
        "spm_sample": args.spm_sample,
        "workers": args.workers,
        "cpu": cpu(),
        "systems": {
            name: {
                **numbers(r.seconds, r.peak_rss, r.peak_pss, args.pairs),
                "output": r.output,
                "stages": {
                    stage: {
                        **numbers(m.seconds, m.peak_rss, m.peak_pss, args.pairs),
                        "command": m.command,
                        "log": m.log,
                    }
                    for stage, m in r.stages.items()
                },
            }
            for name, r in results.items()
        },
        "fairseq_over_fathom_seconds": results["fairseq"].seconds / results["fathom"].seconds
        if len(results) == 2
        else None,
    }


def numbers(seconds: float, peak_rss: int, peak_pss: int | None, pairs: int) -> dict:
    return {
        "seconds": seconds,
        "pairs_per_second": pairs / seconds,
        "peak_rss_bytes": peak_rss,
        "peak_pss_bytes": peak_pss,
    }


def table(results: dict) -> str:
    rows = []
    for name, r in results["systems"].items():
        stages = list(r["stages"].items())
        if len(stages) > 1:
            stages.append(("**total**", r))
        rows += [
            (name, stage, f"{s['seconds']:.1f}", f"{s['pairs_per_second']:,.0f}", mib(s["peak_rss_bytes"]),
             mib(s["peak_pss_bytes"]))
            for stage, s in stages
        ]  # fmt: skip
    header = ("system", "stage", "seconds", "pairs/s", "peak RSS (tree)", "peak PSS (tree)")
    return markdown_table(header, rows, right=range(2, 6))


def summary(results: dict) -> list[str]:
    cpu_ = results["cpu"]
    lines = [
        f"CPU: {cpu_['model']}, {cpu_['cores']} cores ({cpu_['usable_cores']} usable), "
        f"avx512_bf16: {'yes' if cpu_['avx512_bf16'] else 'no'}",
        f"{results['pairs']:,} training pairs, {results['valid_pairs']:,} valid; vocabulary {results['vocab_size']} "
        f"({results['model_type']}), SentencePiece sample {results['spm_sample']:,} sentences, "
        f"{results['workers']} workers",
    ]
    for name, r in results["systems"].items():
        sides = ", ".join(f"{lang} {n:,}" for lang, n in r["output"]["train_pairs"].items())
        lines.append(f"{name} wrote training pairs {sides or 'none'} ({r['output']['bytes'] / 2**20:,.1f} MiB)")
    if results["fairseq_over_fathom_seconds"] is not None:
        lines.append(f"fairseq / fathom wall time: {results['fairseq_over_fathom_seconds']:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        try:
            results = run(args)
        except StageError as err:
            tail = err.log.read_text(errors="replace").splitlines()[-LOG_TAIL:] if err.log.is_file() else []
            print("\n".join(tail), file=sys.stderr)
            print(f"fathom: error: {err}", file=sys.stderr, flush=True)
            sys.exit(1)
        print(table(results))
        print("\n".join(summary(results)))
        if args.json:
            write_atomic(args.json, json.dumps(results, indent=2) + "\n")
