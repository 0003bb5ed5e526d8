"""prepare_data at scale: streamed in chunks over worker processes, SentencePiece on a seeded sample or
given, WMT-style filtering, and shards that training reads as one corpus."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fathom.common.errors import ConfigError
from fathom.corpus import encoded_splits
from fathom.corpus.dataset import BinarizedCorpus, ShardedCorpus
from fathom.corpus.filters import FilterSettings, Pairs, apply
from fathom.corpus.prepare import PrepareOptions, prepare  # as docs/REAL_DATA.md shows users
from fathom.corpus.prepare import main as prepare_main
from fathom.corpus.prepare_options import SPM_SEED
from fathom.pipeline.config.run_config import load_config
from fathom.pipeline.train import main as train_main
from fathom.tools.standin_corpus import write_standin
from tests.helpers import ROOT, contents, write_slice

ARGS = ["--src", "de", "--tgt", "en"]


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    """6,000 WMT-length pairs, and Multi30k's first 100 validation pairs."""
    folder = tmp_path_factory.mktemp("standin")
    write_standin(folder / "train", 6000)
    write_slice(folder, "val", 100)
    return folder


def run_prepare(standin: Path, out: Path, *extra: str) -> dict:
    prepare_main([*ARGS, "--train", str(standin / "train"), "--valid", str(standin / "val"), "--out", str(out), *extra])
    return json.loads((out / "meta.json").read_text())


def test_the_output_is_the_same_bytes_for_any_number_of_workers_and_from_python(standin, tmp_path, monkeypatch):
    """One worker through the command, two through the Python API (prepare(PrepareOptions(...))): the same files."""
    monkeypatch.setattr(encoded_splits, "CHUNK", 700)  # nine chunks, so two workers really share them
    run_prepare(standin, tmp_path / "1", "--vocab-size", "500", "--spm-sample", "4000", "--workers", "1")
    options = PrepareOptions(
        src="de", tgt="en", train=standin / "train", valid=standin / "val", out=tmp_path / "2", vocab_size=500
    )
    meta = prepare(dataclasses.replace(options, spm_sample=4000, workers=2))
    assert contents(tmp_path / "1") == contents(tmp_path / "2")
    assert meta == json.loads((tmp_path / "2" / "meta.json").read_text())


def test_sentencepiece_trains_on_a_seeded_sample_recorded_in_meta(standin, tmp_path):
    meta = run_prepare(standin, tmp_path / "a", "--vocab-size", "500", "--spm-sample", "3000")
    assert meta["sentencepiece"]["trained"]["sample"] == [{"sentences": 3000, "of": 12000}]
    assert meta["sentencepiece"]["trained"]["seed"] == SPM_SEED
    run_prepare(standin, tmp_path / "b", "--vocab-size", "500", "--spm-sample", "3000", "--workers", "1")
    assert (tmp_path / "a" / "spm.model").read_bytes() == (tmp_path / "b" / "spm.model").read_bytes()
    run_prepare(standin, tmp_path / "c", "--vocab-size", "500", "--spm-sample", "3000", "--spm-seed", "2")
    assert (tmp_path / "a" / "spm.model").read_bytes() != (tmp_path / "c" / "spm.model").read_bytes()
    everything = run_prepare(standin, tmp_path / "d", "--vocab-size", "500")  # the default covers 12,000
    assert everything["sentencepiece"]["trained"]["sample"] == [{"sentences": 12000, "of": 12000}]


def test_a_given_sentencepiece_model_is_used_as_it_is(standin, tmp_path, capsys):
    run_prepare(standin, tmp_path / "first", "--vocab-size", "500", "--spm-sample", "3000")
    model = tmp_path / "first" / "spm.model"
    meta = run_prepare(standin, tmp_path / "given", "--spm-model", str(model))
    assert meta["sentencepiece"] == {"given": [str(model)]}
    assert contents(tmp_path / "given")["dict.en.txt"] == contents(tmp_path / "first")["dict.en.txt"]
    assert contents(tmp_path / "given")["train.de.bin"] == contents(tmp_path / "first")["train.de.bin"]
    with pytest.raises(SystemExit):
        run_prepare(standin, tmp_path / "bad", "--spm-model", str(model), "--vocab-size", "800")
    assert f"--spm-model {model}: has 500 pieces but --vocab-size is 800" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_given_dictionaries_are_used_as_they_are(standin, tmp_path):
    """--dict with --spm-model (data for a model imported from fairseq): the data's token ids are the given
    dictionary's, in its order, not one counted from the data."""
    first = tmp_path / "first"
    run_prepare(standin, first, "--vocab-size", "500", "--spm-sample", "3000")
    lines = (first / "dict.en.txt").read_text().split("\n")
    reordered = tmp_path / "dict.en.txt"
    reordered.write_text("\n".join([lines[1], lines[0], *lines[2:]]))
    given = [str(first / "dict.de.txt"), str(reordered)]
    meta = run_prepare(standin, tmp_path / "given", "--spm-model", str(first / "spm.model"), "--dict", *given)
    assert meta["sentencepiece"] == {"given": [str(first / "spm.model")], "dictionaries": given}
    assert (tmp_path / "given" / "dict.en.txt").read_bytes() == reordered.read_bytes()
    counted, ours = BinarizedCorpus(first, "train"), BinarizedCorpus(tmp_path / "given", "train")
    assert not np.array_equal(counted.targets.data, ours.targets.data)  # the two first entries swapped ids
    for i in range(0, len(counted), 97):
        assert counted.tgt_dict.decode(counted.targets[i].tolist()) == ours.tgt_dict.decode(ours.targets[i].tolist())


def test_long_and_unbalanced_training_pairs_are_dropped_and_counted(standin, tmp_path):
    meta = run_prepare(standin, tmp_path / "out", "--vocab-size", "500", "--max-len", "60", "--max-ratio", "1.3")
    train = meta["splits"]["train"]
    assert train["dropped_too_long"] > 0 and train["dropped_ratio"] > 0
    assert train["pairs"] == 6000 - train["dropped_too_long"] - train["dropped_ratio"]
    assert meta["filters"] == {"max_len": 60, "max_ratio": 1.3}
    corpus = BinarizedCorpus(tmp_path / "out", "train")
    src, tgt = corpus.sources.lengths, corpus.targets.lengths
    assert len(corpus) == train["pairs"] and max(src.max(), tgt.max()) <= 60
    assert (np.maximum(src, tgt) <= 1.3 * np.minimum(src, tgt)).all()
    assert meta["splits"]["valid"]["pairs"] == 100  # held-out data keeps every pair


def test_a_pair_is_counted_by_the_first_filter_that_drops_it():
    """corpus.filters in order, on hand-made pairs: held-out splits drop only empty pairs and count the
    kept pairs over --max-len; --max-ratio left out drops nothing."""
    texts = (["a", " ", "b c", "d", "e"], ["x", "y", "", "w", "v"])
    pairs = Pairs(texts, np.array([[3, 1, 2, 9, 2], [3, 1, 0, 9, 6]]))  # pieces per side
    keep, counts = apply(pairs, FilterSettings(max_len=8, max_ratio=2.0), train=True)
    assert keep.tolist() == [True, False, False, False, False]
    assert counts == {"dropped_empty": 2, "dropped_too_long": 1, "dropped_ratio": 1, "kept_too_long": 0}
    keep, counts = apply(pairs, FilterSettings(max_len=8, max_ratio=2.0), train=False)
    assert keep.tolist() == [True, False, False, True, True]
    assert counts == {"dropped_empty": 2, "dropped_too_long": 0, "dropped_ratio": 0, "kept_too_long": 1}
    keep, counts = apply(pairs, FilterSettings(max_len=8), train=True)
    assert keep.tolist() == [True, False, False, False, True] and counts["dropped_ratio"] == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--workers", "0"], "--workers: must be at least 1, got 0"),
        (["--spm-sample", "0"], "--spm-sample: must be at least 1 sentence, got 0"),
        (["--max-ratio", "0.5"], "--max-ratio: must be at least 1"),
        (["--spm-model", "/no/such.model"], "--spm-model /no/such.model: no such file"),
        (["--spm-model", "__file__"], "not a SentencePiece model"),
        (["--vocab-from", "/no/such/dir"], "/no/such/dir: not a prepared data directory"),
        (["--dict", "/no/such.txt"], "--dict: give the SentencePiece model its pieces come from with --spm-model"),
    ],
)
def test_bad_options_are_one_line_before_any_work(standin, tmp_path, capsys, extra, message):
    extra = [str(Path(__file__)) if arg == "__file__" else arg for arg in extra]
    vocab = [] if "--vocab-from" in extra else ["--vocab-size", "500"]
    with pytest.raises(SystemExit) as exc:
        run_prepare(standin, tmp_path / "out", *vocab, *extra)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def shards(standin, tmp_path_factory) -> dict[str, Path]:
    """The stand-in as two shards (the second prepared with --vocab-from the first), and whole, with the
    same vocabulary."""
    folder = tmp_path_factory.mktemp("shards")
    lines = {lang: (standin / f"train.{lang}").read_text().splitlines(True) for lang in ("de", "en")}
    for name, part in (("part0", slice(0, 4000)), ("part1", slice(4000, None))):
        for lang in lines:
            (folder / f"{name}.{lang}").write_text("".join(lines[lang][part]))
    valid = ["--valid", str(standin / "val"), "--spm-sample", "3000"]
    out = {name: folder / name for name in ("shard0", "shard1", "whole")}
    prepare_main([*ARGS, "--train", str(folder / "part0"), *valid, "--vocab-size", "500", "--out", str(out["shard0"])])
    for name, train in (("shard1", folder / "part1"), ("whole", standin / "train")):
        prepare_main(
            [*ARGS, "--train", str(train), *valid, "--vocab-from", str(out["shard0"]), "--out", str(out[name])]
        )
    return out


def test_shards_are_read_as_one_corpus(shards):
    """Two shards give training the very pairs, in the same order, as the corpus prepared whole."""
    for name in ("shard1", "whole"):
        for file in ("dict.de.txt", "dict.en.txt", "spm.model"):
            assert (shards[name] / file).read_bytes() == (shards["shard0"] / file).read_bytes()
    sharded, whole = (
        ShardedCorpus([shards["shard0"], shards["shard1"]], "train"),
        BinarizedCorpus(shards["whole"], "train"),
    )
    assert len(sharded) == len(whole) == 6000
    assert np.array_equal(sharded.lengths(), whole.lengths())
    for index in (0, 3999, 4000, 5999):
        assert all(np.array_equal(a, b) for a, b in zip(sharded.pair(index), whole.pair(index), strict=True))


def test_a_list_of_shards_trains_with_validation_from_the_first(shards, tmp_path):
    config = ROOT / "ds_configs" / "default.json"
    cfg = load_config(config, [f"data.path={json.dumps([str(shards['shard0']), str(shards['shard1'])])}"], 2)
    assert cfg.data.shards == [str(shards["shard0"]), str(shards["shard1"])]
    assert cfg.data.directory == str(shards["shard0"])


def test_shards_with_other_dictionaries_are_one_line(shards, standin, tmp_path, capsys, monkeypatch):
    other = tmp_path / "other"
    run_prepare(standin, other, "--vocab-size", "400", "--spm-sample", "3000")
    with pytest.raises(
        ConfigError,
        match=f"shard {other} has another dict.de.txt than {shards['shard0']}; prepare it with --vocab-from",
    ):
        ShardedCorpus([shards["shard0"], other], "train")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for path, message in (
        ([str(shards["shard0"]), str(other)], f"shard {other} has another dict.de.txt"),
        (
            [str(shards["shard0"]), str(tmp_path / "nothing")],
            f"{tmp_path / 'nothing'} is not a prepared data directory",
        ),
        ([str(shards["shard0"])] * 2, "names a shard twice"),
        ([], "data.path: an empty list"),
    ):
        with pytest.raises(SystemExit) as exc:
            train_main(["--config", str(ROOT / "ds_configs" / "default.json"), "--override",
                        f"data.path={json.dumps(path)}", f"train.save_dir={tmp_path / 'run'}"])  # fmt: skip
        err = [line for line in capsys.readouterr().err.splitlines() if "fathom: error" in line]
        assert exc.value.code == 2 and len(err) == 1 and message in err[0], err
        assert not (tmp_path / "run").exists()


PEAK = """
import resource, sys
from fathom.corpus.prepare import main
main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.slow
def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """Ten times the pairs, the same peak: nothing holds the corpus (one process, the same sample)."""
    peaks = {}
    valid = write_slice(tmp_path, "val", 50)
    for pairs in (10_000, 200_000):
        write_standin(tmp_path / f"train{pairs}", pairs)
        args = [*ARGS, "--train", str(tmp_path / f"train{pairs}"), "--valid", valid, "--vocab-size", "500",
                "--spm-sample", "5000", "--workers", "1", "--out", str(tmp_path / f"out{pairs}")]  # fmt: skip
        result = subprocess.run([sys.executable, "-c", PEAK, *args], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        peaks[pairs] = int(result.stdout.split()[-1]) / 1024  # MiB
    assert peaks[200_000] < peaks[10_000] + 25, peaks


@pytest.mark.slow
def test_ctrl_c_while_preparing_is_one_line_and_leaves_nothing(tmp_path):
    """Ctrl-C during fathom-prepare (or fathom-export) printed a KeyboardInterrupt traceback; nothing
    half-written was left, which holds. Now it is one line and status 130, as a stopped training run says."""
    import gzip
    import signal
    import time

    out = tmp_path / "data-bin"
    for lang in ("de", "en"):  # Multi30k's training text 8 times: long enough to be stopped midway
        with gzip.open(ROOT / "data" / "multi30k" / f"train.{lang}.gz", "rt", encoding="utf-8") as text:
            (tmp_path / f"train.{lang}").write_text(text.read() * 8, encoding="utf-8")
    command = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--src", "de", "--tgt", "en", "--train",
               "train", "--valid", "multi30k/val", "--vocab-size", "8000", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = ""
    while "reading train" not in said and proc.poll() is None:  # at work, past the imports
        said += proc.stderr.read(1)
    time.sleep(1)  # reading the corpus or training SentencePiece, whichever it is in
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = said + err
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "fathom: stopped by SIGINT (Ctrl-C); nothing half-written is left"
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".data-bin")]


def test_a_ctrl_c_in_any_command_is_one_line_and_status_130(capsys):
    from fathom.common.errors import exit_on_config_error

    with pytest.raises(SystemExit) as stopped, exit_on_config_error():
        raise KeyboardInterrupt
    assert stopped.value.code == 130
    assert capsys.readouterr().err == "fathom: stopped by SIGINT (Ctrl-C); nothing half-written is left\n"


def test_an_output_directory_is_written_by_one_command_at_a_time(tmp_path):
    """Two preparations into one new --out at the same time both succeeded, the second replacing the first:
    the check that --out does not exist runs at the start only. Now the second is refused while the first
    writes, and an --out that appeared meanwhile is replaced only with --force (every command that stages an
    output directory: prepare, export, import, average)."""
    from fathom.common.files import staged

    out = tmp_path / "data-bin"
    with staged(out) as first:
        (first / "meta.json").write_text("first")
        with pytest.raises(ConfigError, match=rf"{out}: another command is writing it now \(pid {os.getpid()}\)"):
            with staged(out):
                pass
    assert (out / "meta.json").read_text() == "first" and not list(tmp_path.glob(".data-bin*"))
    with pytest.raises(ConfigError, match="appeared while this command ran; pass --force to replace it"):
        with staged(out) as second:
            (second / "meta.json").write_text("second")
    assert (out / "meta.json").read_text() == "first"
    with staged(out, replace=True) as forced:
        (forced / "meta.json").write_text("forced")
    assert (out / "meta.json").read_text() == "forced" and not list(tmp_path.glob(".data-bin*"))


@pytest.mark.slow
def test_a_second_preparation_into_the_same_new_out_is_refused_while_the_first_runs(tmp_path):
    import gzip
    import time

    for lang in ("de", "en"):  # long enough for the second to start while the first writes
        with gzip.open(ROOT / "data" / "multi30k" / f"train.{lang}.gz", "rt", encoding="utf-8") as text:
            (tmp_path / f"train.{lang}").write_text(text.read() * 8, encoding="utf-8")
    out = tmp_path / "same"

    def command(vocab: int) -> list[str]:
        return [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--src", "de", "--tgt", "en", "--train",
                "train", "--valid", "multi30k/val", "--vocab-size", str(vocab), "--out", str(out)]  # fmt: skip

    first = subprocess.Popen(command(1000), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / ".same.lock").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.run(command(800), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    first.communicate(timeout=300)
    assert first.returncode == 0, "the first preparation failed"
    refused = f"fathom: error: {out}: another command is writing it now (pid {first.pid})"
    assert second.returncode == 2 and second.stderr.strip().splitlines()[-1].startswith(refused), second.stderr
    assert json.loads((out / "meta.json").read_text())["vocab"] == {"de": 1008, "en": 1008}  # the first's 1000


def test_both_sides_of_a_prefix_come_from_one_folder(tmp_path, monkeypatch, capsys):
    """With ./multi30k/test_2016_flickr.en present and no .de beside it, `--test multi30k/test_2016_flickr` took
    German from the shipped corpus and English from ./multi30k: the test set silently mispaired, exit 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "multi30k").mkdir()
    (tmp_path / "multi30k" / "test_2016_flickr.en").write_text("a local file of that name\n")
    with pytest.raises(SystemExit) as refused:
        prepare_main(["--src", "de", "--tgt", "en", "--train", "multi30k/train", "--valid", "multi30k/val", "--test",
                      "multi30k/test_2016_flickr", "--vocab-size", "500", "--out", str(tmp_path / "out")])  # fmt: skip
    assert refused.value.code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err == (
        "fathom: error: multi30k/test_2016_flickr.en is here but multi30k/test_2016_flickr.de is not (nor "
        "multi30k/test_2016_flickr.de.gz): both sides of a prefix come from one folder; add the other side or give "
        "a prefix that has both\n"
    )


def test_meta_records_the_files_each_split_was_read_from(standin, tmp_path):
    meta = run_prepare(standin, tmp_path / "out", "--vocab-size", "500", "--spm-sample", "4000")
    assert meta["splits"]["train"]["read_from"] == [str((standin / "train.de").resolve()),
                                                    str((standin / "train.en").resolve())]  # fmt: skip
