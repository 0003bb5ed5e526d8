"""scripts/bench_prepare.py: its refusals of bad arguments (before anything is written), the stand-in
corpus it times both systems on, the memory sampler, and, where fairseq's environment is built, the
whole benchmark on a small corpus."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fathom.common.run_layout import META_FILE
from fathom.tools.preparation_speed import WORK_STAMP, build_corpus, check_work, main
from fathom.tools.process_sampling import run_sampled

VALID_PAIRS = 1014  # Multi30k's val split


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pairs", "0"], "--pairs: must be at least 1, got 0"),
        (["--workers", "0"], "--workers: must be at least 1, got 0"),
        (["--spm-sample", "0"], "--spm-sample: must be at least 1, got 0"),
        (["--vocab-size", "4"], "--vocab-size: must be at least 8, got 4"),
        (["--systems", "fathom,nope"], "--systems: unknown system 'nope'"),
        (["--fairseq-env", "/no/such/env"], "--fairseq-env /no/such/env: no bin/python"),
        (["--json", "/no-dir/bench.json"], "--json /no-dir/bench.json: /no-dir is not a directory"),
    ],
)
def test_bad_arguments_are_one_line_before_any_work(tmp_path, capsys, args, message):
    """On a machine that never built fairseq's environment, too: an argument's own error comes first."""
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as exc:
        main(["--pairs", "10", "--work", str(work), "--fairseq-env", str(tmp_path / "never-built"), *args])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not work.exists()


def test_a_missing_fairseq_env_is_fine_when_fairseq_is_not_run(tmp_path, capsys):
    """Only the systems asked for need their tools: a bad --work is what is refused here."""
    (tmp_path / "other.txt").write_text("someone's file\n")
    with pytest.raises(SystemExit) as exc:
        main(["--pairs", "10", "--work", str(tmp_path), "--systems", "fathom", "--fairseq-env", "/no/such/env"])
    assert exc.value.code == 2 and "holds files this benchmark did not write" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["prepared", "other"])
def test_work_is_never_a_directory_of_other_files(tmp_path, capsys, content):
    """The benchmark deletes its outputs under --work: a prepared data directory, or one of someone
    else's files, is refused and left as it was."""
    name = META_FILE if content == "prepared" else "notes.txt"
    (tmp_path / name).write_text("{}\n")
    (tmp_path / "fathom").mkdir()  # a name the benchmark's own outputs have
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as exc:
        main(["--pairs", "10", "--work", str(tmp_path), "--systems", "fathom"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert ("prepared data directory" if content == "prepared" else WORK_STAMP) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_standin_corpus_is_deterministic_line_aligned_and_reused(tmp_path):
    first, second = tmp_path / "a" / "corpus", tmp_path / "b" / "corpus"
    assert build_corpus(first, 500) is False and build_corpus(second, 500) is False
    for name in ("train.de", "train.en", "valid.de", "valid.en"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert len(lines(first / "train.de")) == len(lines(first / "train.en")) == 500
    assert len(lines(first / "valid.de")) == len(lines(first / "valid.en")) == VALID_PAIRS
    assert all(line.strip() for name in ("train.de", "train.en") for line in lines(first / name))
    written = (first / "train.de").stat().st_mtime_ns
    assert build_corpus(first, 500) is True and (first / "train.de").stat().st_mtime_ns == written
    (first / "train.en").write_text("cut short\n")  # a damaged corpus is written again, not reused
    assert build_corpus(first, 500) is False and len(lines(first / "train.en")) == 500
    assert build_corpus(first, 300) is False and len(lines(first / "train.de")) == 300
    assert not [p for p in first.parent.iterdir() if p.name != "corpus"]  # no staging left behind


@pytest.mark.slow
def test_peak_memory_sums_the_process_tree(tmp_path):
    """A parent that only waits for a child that holds 200 MB: the child's memory is the tree's."""
    child = "import time; block = b'x' * (200 << 20); time.sleep(1.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    measured = run_sampled("test", [sys.executable, "-c", parent], tmp_path / "log")
    assert measured.peak_rss > 200 << 20 and measured.peak_pss > 190 << 20
    assert measured.seconds > 1.5


@pytest.mark.slow
def test_both_systems_prepare_the_corpus_end_to_end(tmp_path, capsys, fairseq_bin):
    work, results = tmp_path / "work", tmp_path / "bench.json"
    argv = [
        "--fairseq-env",
        str(fairseq_bin.parent),
        "--pairs",
        "3000",
        "--vocab-size",
        "500",
        "--workers",
        "2",
        "--work",
        str(work),
        "--json",
        str(results),
    ]
    main(argv)
    out = capsys.readouterr().out
    assert "| fairseq | preprocess |" in out and "fairseq / fathom wall time:" in out
    report = json.loads(results.read_text())
    for name, system in report["systems"].items():
        assert system["output"]["train_pairs"] == {"de": 3000, "en": 3000}, name
        assert system["seconds"] > 0 and system["peak_rss_bytes"] > 0
    stages = report["systems"]["fairseq"]["stages"]
    assert list(stages) == ["spm train", "spm encode", "preprocess"]
    assert "--joined-dictionary" in stages["preprocess"]["command"]
    # the prepared outputs are gone; the corpus stays for the next run, which may use the directory again
    assert sorted(p.name for p in work.iterdir()) == sorted([WORK_STAMP, "corpus", "logs"])
    assert build_corpus(work / "corpus", 3000) is True
    check_work(work)
