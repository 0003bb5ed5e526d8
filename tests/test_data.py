"""prepare_data on real Multi30k lines and on bad input; dictionaries; token batching."""

import gzip
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fathom.common.errors import ConfigError
from fathom.corpus.batches import BatchSize, MicroBatches, epoch_batches, fairseq_batches
from fathom.corpus.dataset import BinarizedCorpus, Dictionary, file_record
from fathom.corpus.prepare import main as prepare_main
from fathom.model.model_config import EOS, NUM_SPECIAL, PAD
from fathom.pipeline.train import main as train_main
from fathom.translation.generate import main as generate_main
from tests.helpers import MULTI30K, ROOT, write_slice


def prepare(tmp_path, train, valid, *extra):
    args = ["--src", "de", "--tgt", "en", "--train", train, "--valid", valid, "--vocab-size", "300"]
    prepare_main([*args, "--out", str(tmp_path / "out"), *extra])


def expect_error(capsys, tmp_path, train, valid, *extra):
    with pytest.raises(SystemExit) as exc:
        prepare(tmp_path, train, valid, *extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err.split("\r")[-1].strip()  # after the progress bars, cleared as they end
    assert len(err.splitlines()) == 1, err
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert not leftovers, f"half-written output left behind: {leftovers}"
    return err


def test_prepared_multi30k_slice(multi30k_slice):
    meta = json.loads((multi30k_slice / "meta.json").read_text())
    assert meta["splits"]["train"]["pairs"] == 400 and meta["splits"]["test"]["pairs"] == 50
    corpus = BinarizedCorpus(multi30k_slice, "test")
    assert len(corpus) == 50 and corpus.src_vocab_size == corpus.tgt_vocab_size == meta["vocab"]["en"]
    assert (multi30k_slice / "dict.de.txt").read_text() == (multi30k_slice / "dict.en.txt").read_text()
    src, tgt = corpus.pair(0)
    assert src.min() >= NUM_SPECIAL and tgt.min() >= NUM_SPECIAL
    refs = (multi30k_slice / "test.raw.en").read_text().splitlines()
    with gzip.open(MULTI30K / "test_2016_flickr.en.gz", "rt") as f:
        assert refs[0] == next(f).rstrip("\n")


def test_dictionary_round_trip_in_fairseq_order(multi30k_slice, tmp_path):
    d = Dictionary.load(multi30k_slice / "dict.en.txt")
    assert d.symbols[:4] == ["<s>", "<pad>", "</s>", "<unk>"] and (d.index["<pad>"], d.index["</s>"]) == (PAD, EOS)
    assert len(d) % 8 == 0
    counts = d.counts[NUM_SPECIAL:]
    assert counts == sorted(counts, reverse=True)
    d.save(tmp_path / "dict.txt")
    again = Dictionary.load(tmp_path / "dict.txt")
    assert again.symbols == d.symbols and again.counts == d.counts
    first_line = (multi30k_slice / "dict.en.txt").read_text().splitlines()[0]
    assert d.symbols[NUM_SPECIAL] == first_line.rsplit(" ", 1)[0]  # file line 1 is index 4


def test_separate_vocabularies(tmp_path):
    train, valid = write_slice(tmp_path, "train", 200), write_slice(tmp_path, "val", 20)
    prepare(tmp_path, train, valid, "--separate-vocab")
    out = tmp_path / "out"
    assert (out / "spm.de.model").exists() and (out / "spm.en.model").exists()
    assert (out / "dict.de.txt").read_text() != (out / "dict.en.txt").read_text()


def test_shared_embeddings_over_separate_dictionaries_of_one_size_are_refused(tmp_path, capsys, monkeypatch):
    """Equal sizes passed the check, and each token id then meant one word in German, another in English."""
    train, valid = write_slice(tmp_path, "train", 200), write_slice(tmp_path, "val", 20)
    prepare(tmp_path, train, valid, "--separate-vocab")
    assert len((tmp_path / "out" / "dict.de.txt").read_text().splitlines()) == len(
        (tmp_path / "out" / "dict.en.txt").read_text().splitlines()
    )
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        train_main(["--config", str(ROOT / "ds_configs" / "default.json"), "--override",
                    f"data.path={tmp_path / 'out'}", "model.share_all_embeddings=true",
                    f"train.save_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("fathom: error: model.share_all_embeddings: the data has separate")
    assert not (tmp_path / "run").exists()


def test_mismatched_line_counts(tmp_path, capsys):
    train, valid = write_slice(tmp_path, "train", 100), write_slice(tmp_path, "val", 20)
    (tmp_path / "train.en").write_text("".join((tmp_path / "train.en").read_text().splitlines(True)[:99]))
    err = expect_error(capsys, tmp_path, train, valid)
    assert "train.de has 100 lines but" in err and "train.en has 99" in err
    assert not (tmp_path / "out").exists()


def test_invalid_utf8(tmp_path, capsys):
    train, valid = write_slice(tmp_path, "train", 100), write_slice(tmp_path, "val", 20)
    raw = (tmp_path / "train.de").read_bytes().split(b"\n")
    raw[6] = "Größe".encode("latin-1")
    (tmp_path / "train.de").write_bytes(b"\n".join(raw))
    err = expect_error(capsys, tmp_path, train, valid)
    assert "train.de:7: not valid UTF-8" in err


@pytest.mark.parametrize("damage", ["cut short", "not gzip", "flipped byte"])
def test_a_damaged_gzip_input_is_one_line(tmp_path, capsys, damage):
    """A download cut short was a Python EOFError traceback."""
    train, valid = write_slice(tmp_path, "train", 100), write_slice(tmp_path, "val", 20)
    packed = bytearray(gzip.compress((tmp_path / "train.de").read_bytes()))
    packed = {"cut short": packed[: len(packed) // 2], "not gzip": b"plain text", "flipped byte": packed}[damage]
    if damage == "flipped byte":
        packed[len(packed) // 2] ^= 0xFF
    (tmp_path / "train.de").unlink()
    (tmp_path / "train.de.gz").write_bytes(bytes(packed))
    err = expect_error(capsys, tmp_path, train, valid)
    assert "train.de.gz: not a whole gzip file" in err and "download or compress it again" in err, err
    assert not (tmp_path / "out").exists()


def test_validation_made_of_training_pairs_is_refused_and_overlap_warned(tmp_path, capsys):
    """--valid given the train prefix again validated on the training data, silently."""
    train, valid = write_slice(tmp_path, "train", 100), write_slice(tmp_path, "val", 20)
    err = expect_error(capsys, tmp_path, train, train)
    assert f"valid ({train}): every pair is also a training pair; give held-out data" in err, err
    for lang in ("de", "en"):  # 5 of 25 validation pairs copied from train
        lines = (tmp_path / f"train.{lang}").read_text().splitlines(True)[:5]
        (tmp_path / f"val.{lang}").write_text((tmp_path / f"val.{lang}").read_text() + "".join(lines))
    prepare(tmp_path, train, valid)
    assert f"fathom: warning: valid ({valid}): 5 of 25 pairs are training pairs too" in capsys.readouterr().err


@pytest.mark.slow
def test_a_full_disk_is_one_line_that_does_not_blame_the_vocabulary(tmp_path):
    """SentencePiece cannot read back a model it could not write whole; the line said: smaller --vocab-size."""
    train, valid = write_slice(tmp_path, "train", 100), write_slice(tmp_path, "val", 20)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    result = subprocess.run(
        [sys.executable, "scripts/prepare_data.py", "--src", "de", "--tgt", "en", "--train", train, "--valid", valid,
         "--vocab-size", "300", "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20000, hard)),
    )  # fmt: skip
    err = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and err.startswith("fathom: error: SentencePiece") and f"is {tmp_path} full?" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.de", "train.en", "val.de", "val.en"]


def test_empty_and_long_pairs_are_dropped_and_counted(tmp_path):
    train, valid = write_slice(tmp_path, "train", 100), write_slice(tmp_path, "val", 20)
    de = (tmp_path / "train.de").read_text().splitlines(True)
    de[3] = "\n"
    de[5] = "   \n"
    (tmp_path / "train.de").write_text("".join(de))
    prepare(tmp_path, train, valid, "--max-len", "20")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())["splits"]["train"]
    assert meta["dropped_empty"] == 2 and meta["dropped_too_long"] > 0
    assert meta["pairs"] == 100 - 2 - meta["dropped_too_long"]
    corpus = BinarizedCorpus(tmp_path / "out", "train")
    assert len(corpus) == meta["pairs"] and corpus.lengths().max() <= 21


def test_force_replaces_only_an_earlier_output(tmp_path, capsys, monkeypatch):
    """--force used to delete whatever --out named: `--out . --force` emptied the working directory, and
    convert_to_fairseq.py --out RUN --force deleted the run it converted."""
    train, valid = write_slice(tmp_path, "train", 100), write_slice(tmp_path, "val", 20)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert "already exists; choose a new --out or pass --force" in expect_error(capsys, tmp_path, train, valid)
    message = expect_error(capsys, tmp_path, train, valid, "--force")
    assert "exists and was not written by this script (no meta.json), so --force does not replace it" in message
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    (tmp_path / "out" / "keep.txt").unlink()
    prepare(tmp_path, train, valid)
    prepare(tmp_path, train, valid, "--force")  # an earlier output of prepare_data.py
    assert (tmp_path / "out" / "meta.json").exists()
    monkeypatch.chdir(tmp_path)
    args = ["--src", "de", "--tgt", "en", "--train", train, "--valid", valid, "--vocab-size", "300", "--force"]
    for out in (".", str(tmp_path.parent)):
        with pytest.raises(SystemExit):
            prepare_main([*args, "--out", out])
        assert "is or holds the current directory, which replacing it would delete" in capsys.readouterr().err
    (tmp_path / "inputs").mkdir()
    inputs = write_slice(tmp_path / "inputs", "train", 100)
    shutil.copy(tmp_path / "out" / "meta.json", tmp_path / "inputs")  # looks like an earlier output
    with pytest.raises(SystemExit):
        prepare_main([*args, "--train", inputs, "--out", str(tmp_path / "inputs")])
    assert f"is or holds the input {inputs}" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "inputs").iterdir()) == ["meta.json", "train.de", "train.en"]
    # an input spelled through a link into the output: its prefix is elsewhere, its file inside --out
    (tmp_path / "linked").mkdir()
    for lang in ("de", "en"):
        (tmp_path / "linked" / f"train.{lang}").symlink_to(tmp_path / "inputs" / f"train.{lang}")
    with pytest.raises(SystemExit):
        prepare_main([*args, "--train", str(tmp_path / "linked" / "train"), "--out", str(tmp_path / "inputs")])
    assert f"is or holds the input {tmp_path / 'linked' / 'train.de'}" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "inputs").iterdir()) == ["meta.json", "train.de", "train.en"]


def test_an_output_directory_never_goes_inside_a_checkpoint_or_prepared_data(tmp_path, capsys, multi30k_slice):
    """--out RUN/best_global_step12/data was written, then deleted with that best once a better one came;
    inside prepared data it sat among checksummed files. The same check guards train.save_dir, a study's
    out and the converters' --out."""
    train, valid = write_slice(tmp_path, "train", 50), write_slice(tmp_path, "val", 20)
    run = tmp_path / "run"
    (run / "best_global_step12").mkdir(parents=True)
    (run / "best_global_step12" / "mp_rank_00_model_states.pt").write_bytes(b"")
    args = ["--src", "de", "--tgt", "en", "--train", train, "--valid", valid, "--vocab-size", "300"]
    for out, message in (
        (run / "best_global_step12" / "data", f"is inside the checkpoint {run / 'best_global_step12'}, which holds"),
        (multi30k_slice / "more" / "data", f"is inside the prepared data directory {multi30k_slice}; choose"),
    ):
        with pytest.raises(SystemExit) as exc:
            prepare_main([*args, "--out", str(out)])
        err = capsys.readouterr().err.split("\r")[-1].strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
        assert not out.exists() and not list(out.parent.glob(".data*"))


def test_same_language_on_both_sides_is_one_line(tmp_path, capsys):
    """--src de --tgt de wrote both sides to the same files."""
    train, valid = write_slice(tmp_path, "train", 50), write_slice(tmp_path, "val", 20)
    assert "--src and --tgt are both 'de'" in expect_error(capsys, tmp_path, train, valid, "--tgt", "de")


def test_missing_file_and_bad_vocab_size_leave_nothing(tmp_path, capsys):
    train, valid = write_slice(tmp_path, "train", 50), write_slice(tmp_path, "val", 20)
    assert "nope.de: no such file" in expect_error(capsys, tmp_path, str(tmp_path / "nope"), valid)
    args = ["--src", "de", "--tgt", "en", "--train", train, "--valid", valid, "--vocab-size", "100000"]
    with pytest.raises(SystemExit):
        prepare_main([*args, "--out", str(tmp_path / "out")])
    assert "SentencePiece" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.fixture
def lengths():
    return np.random.default_rng(0).integers(2, 60, size=997)


def test_token_batches_cover_the_epoch_once_within_budget(lengths):
    size = BatchSize(max_tokens=256)
    for epoch in (0, 1):
        batches = epoch_batches(lengths, size, seed=3, epoch=epoch)
        seen = np.sort(np.concatenate(batches))
        assert np.array_equal(seen, np.arange(len(lengths)))
        assert all(lengths[b].max() * len(b) <= 256 for b in batches)
    spread = [lengths[b].max() - lengths[b].min() for b in epoch_batches(lengths, size, seed=3, epoch=0)]
    assert np.mean(spread) < 3  # grouped by length
    assert epoch_batches(lengths, size, 3, 0)[0].tolist() != epoch_batches(lengths, size, 3, 1)[0].tolist()


def test_generation_batches_are_fairseq_generates():
    """fairseq-generate's batches of a split, as fairseq 0.12.2's LanguagePairDataset.ordered_indices and
    batch_by_size made them from these lengths (--batch-size 10 and 20, its defaults --seed 1 and
    --required-batch-size-multiple 8): by source length, ties by target length and then by index in the
    split named test, by a permutation drawn with the seed in any other; runs of the multiple of 8 below
    the batch size, the rest cut into a multiple of 8 and what remains. generate.py batched 10 by 10,
    ties by index, so a sentence whose hypothesis reached the output limit (a x the batch's longest
    source + b) could get another limit than fairseq's."""
    src = np.array([5, 3, 5, 5, 2, 3, 5, 4, 4, 5, 3, 2, 5, 4, 5, 5, 3, 4, 5, 5, 4, 5, 2, 5, 3])
    tgt = np.array([6, 3, 4, 6, 2, 3, 4, 5, 4, 7, 3, 2, 6, 4, 4, 6, 3, 4, 5, 4, 4, 6, 2, 4, 3])
    test = [[4, 11, 22, 1, 5, 10, 16, 24], [8, 13, 17, 20, 7, 2, 6, 14], [19, 23, 18, 0, 3, 12, 15, 21], [9]]
    other = [[4, 22, 11, 10, 1, 16, 24, 5], [13, 17, 20, 8, 7, 14, 19, 2], [6, 23, 18, 3, 21, 0, 15, 12], [9]]
    assert fairseq_batches(src, tgt, 10, shuffled=False) == test
    assert fairseq_batches(src, tgt, 10, shuffled=True) == other
    assert fairseq_batches(src, tgt, 20, shuffled=False) == [test[0] + test[1], *test[2:]]
    assert fairseq_batches(src, tgt, 20, shuffled=True) == [other[0] + other[1], *other[2:]]
    assert fairseq_batches(src, tgt, 5, shuffled=False) == [sum(test, [])[i : i + 5] for i in range(0, 25, 5)]


def test_token_budget_resumes_mid_epoch(multi30k_slice):
    corpus = BinarizedCorpus(multi30k_slice, "train")
    size = BatchSize(max_tokens=300)
    full = MicroBatches(corpus, size, seed=1)
    batches = [next(full) for _ in range(2 * 30)]  # several epochs of the 400 pairs
    resumed = MicroBatches(corpus, size, seed=1, start=26)
    for expected in batches[26:]:
        got = next(resumed)
        (src, _), target = got
        assert max(src.size(1), target.size(1)) * target.size(0) <= 300
        assert all(a.equal(b) for a, b in zip((*got[0], got[1]), (*expected[0], expected[1]), strict=True))


def test_budget_below_longest_pair_is_a_config_error(multi30k_slice):
    corpus = BinarizedCorpus(multi30k_slice, "train")
    with pytest.raises(ConfigError, match="data.max_tokens: 10 is below the longest training pair"):
        MicroBatches(corpus, BatchSize(max_tokens=10), seed=1)


def test_prepare_refuses_to_write_a_split_with_no_pairs(tmp_path, capsys):
    train, valid = write_slice(tmp_path, "train", 100), write_slice(tmp_path, "val", 20)
    err = expect_error(capsys, tmp_path, train, valid, "--max-len", "1")
    assert err == "fathom: error: train: no pairs left (100 over --max-len 1 dropped); raise --max-len"
    (tmp_path / "val.en").write_text("\n" * 20)
    assert "val: no pair with text on both sides" in expect_error(capsys, tmp_path, train, valid)
    assert not (tmp_path / "out").exists()


def damaged_copy(data, tmp_path, damage) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    damage(copy)
    return copy


def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)


def without_checksums(data: Path) -> None:
    meta = json.loads((data / "meta.json").read_text())
    del meta["files"]
    (data / "meta.json").write_text(json.dumps(meta))


DAMAGE = {
    # train.de.bin cut to an even size: every offset still "fits" a shorter sentence
    "truncated": (lambda d: truncate(d / "train.de.bin", 600), "train.de.bin: 600 bytes, but prepare_data wrote"),
    "flipped byte": (lambda d: flip_a_byte(d / "train.en.bin"), "train.en.bin: fails its checksum"),
    "foreign file": (
        lambda d: shutil.copy(d / "valid.de.bin", d / "train.de.bin"),
        "train.de.bin: 3920 bytes, but prepare_data wrote 24980",
    ),
    "missing dictionary": (lambda d: (d / "dict.en.txt").unlink(), "dict.en.txt: missing from the data directory"),
    "missing index": (lambda d: (d / "train.de.idx.npy").unlink(), "train.de.idx.npy: missing from the data"),
    "bad meta.json": (lambda d: truncate(d / "meta.json", 100), "meta.json: not valid JSON"),
    "meta.json without splits": (
        lambda d: (d / "meta.json").write_text('{"src": "de", "tgt": "en", "dtype": "uint16"}'),
        "meta.json: no dict 'splits'; the data directory is damaged",
    ),
    # an older data directory has no checksums; the index still catches a truncated .bin
    "truncated, no checksums": (
        lambda d: (without_checksums(d), truncate(d / "train.de.bin", 600)),
        "train.de.bin: 300 tokens, but train.de.idx.npy indexes",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_data_directory_is_one_line_before_training(case, multi30k_slice, tmp_path, capsys, monkeypatch):
    damage, message = DAMAGE[case]
    data = damaged_copy(multi30k_slice, tmp_path, damage)
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = ["--config", str(ROOT / "ds_configs" / "default.json"), "--override", f"data.path={data}"]
    with pytest.raises(SystemExit) as exc:
        train_main([*config, f"train.save_dir={tmp_path / 'run'}"])
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "fathom: error: " in line]
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["flipped byte", "missing dictionary"])
def test_a_damaged_data_directory_is_one_line_for_generate(case, multi30k_slice, tmp_path, capsys):
    damage, message = DAMAGE[case]
    data = damaged_copy(multi30k_slice, tmp_path, damage)
    with pytest.raises(SystemExit) as exc:
        generate_main(["--checkpoint", str(tmp_path), "--data", str(data), "--subset", "train"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_machines_other_ranks_check_sizes_and_leave_checksums_to_its_first(multi30k_slice, tmp_path):
    """Every rank reading a WMT-size directory whole cost minutes a launch: one rank a machine does."""
    flipped = damaged_copy(multi30k_slice, tmp_path / "flipped", lambda d: flip_a_byte(d / "train.en.bin"))
    assert len(BinarizedCorpus(flipped, "train", checksums=False)) == 400
    with pytest.raises(ConfigError, match="train.en.bin: fails its checksum"):
        BinarizedCorpus(flipped, "train")
    cut = damaged_copy(multi30k_slice, tmp_path / "cut", lambda d: truncate(d / "train.de.bin", 600))
    with pytest.raises(ConfigError, match="train.de.bin: 600 bytes, but prepare_data wrote"):
        BinarizedCorpus(cut, "train", checksums=False)


def test_references_are_verified_before_scoring(multi30k_slice, tmp_path):
    """A reference file edited after preparation would be scored against silently."""
    data = damaged_copy(multi30k_slice, tmp_path, lambda d: flip_a_byte(d / "test.raw.en"))
    with pytest.raises(ConfigError, match="test.raw.en: fails its checksum"):
        BinarizedCorpus(data, "test").references()


def test_a_split_with_no_pairs_is_refused_where_it_is_read(multi30k_slice, tmp_path):
    def empty_valid(d: Path) -> None:
        meta = json.loads((d / "meta.json").read_text())
        for lang in ("de", "en"):
            (d / f"valid.{lang}.bin").write_bytes(b"")  # no tokens, and offsets [0]: no sentences
            np.save(d / f"valid.{lang}.idx.npy", np.zeros(1, np.int64))
            for name in (f"valid.{lang}.bin", f"valid.{lang}.idx.npy"):
                meta["files"][name] = file_record(d / name)
        meta["splits"]["valid"]["pairs"] = 0
        (d / "meta.json").write_text(json.dumps(meta))

    data = damaged_copy(multi30k_slice, tmp_path, empty_valid)
    with pytest.raises(ConfigError, match="split 'valid' has no pairs"):
        BinarizedCorpus(data, "valid")


def test_force_onto_a_file_is_one_line_before_any_work(tmp_path, capsys):
    """--force replaces a directory; a file there (or on the way) used to fail after all the work."""
    train, valid = write_slice(tmp_path, "train", 50), write_slice(tmp_path, "val", 20)
    (tmp_path / "out").write_text("mine")
    assert "--out: " in expect_error(capsys, tmp_path, train, valid, "--force")
    args = ["--src", "de", "--tgt", "en", "--train", train, "--valid", valid, "--vocab-size", "300", "--force"]
    with pytest.raises(SystemExit):
        prepare_main([*args, "--out", str(tmp_path / "out" / "sub")])
    assert f"{tmp_path / 'out'} is a file, so" in capsys.readouterr().err
    assert (tmp_path / "out").read_text() == "mine"


def greedy_batches(size: BatchSize, order: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """The packing rule, one pair at a time: what BatchSize.pack computes with numpy."""
    batches, start, longest = [], 0, 0
    for i, index in enumerate(order):
        longest_with, count = max(longest, lengths[index]), i - start + 1
        full = (size.sentences is not None and count > size.sentences) or (
            size.max_tokens is not None and longest_with * count > size.max_tokens
        )
        if full and i > start:
            batches.append(order[start:i])
            start, longest_with = i, lengths[index]
        longest = longest_with
    if start < len(order):
        batches.append(order[start:])
    return batches


@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("size", [BatchSize(sentences=7), BatchSize(max_tokens=300), BatchSize(5, 300)])
def test_packing_follows_the_greedy_rule(size, sort):
    lengths = np.random.default_rng(1).integers(2, 150, size=5000)
    order = np.random.default_rng(2).permutation(len(lengths))
    if sort:
        order = order[np.argsort(lengths[order], kind="stable")]
    got, want = size.pack(order, lengths), greedy_batches(size, order, lengths)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
