"""scripts/translate.py: raw text in and out in input order, the same translations as generate.py on a
prepared split, long lines cut with a warning, and every bad input one line with nothing written."""

import io
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fathom.common.errors import ConfigError
from fathom.corpus.dataset import PreparedData
from fathom.corpus.prepare import main as prepare_main
from fathom.model import ModelConfig, Transformer
from fathom.model.search import SearchConfig
from fathom.tools.translation_speed import main as bench_translate_main
from fathom.translation.decoding_flags import search_config
from fathom.translation.generate import main as generate_main
from fathom.translation.generate import parse_args as parse_generate_args
from fathom.translation.generate import translate_split
from fathom.translation.translate import main as translate_main
from fathom.translation.translator import Translator
from tests.helpers import ROOT, write_run, write_slice

# A fixed output limit: with max_len_a > 0 the limit follows the batch's longest source (as fairseq's), and
# these untrained models run every hypothesis to the limit, so batch sizes could not be compared.
SEARCH = ["--beam", "3", "--lenpen", "0.6", "--max-len-a", "0", "--max-len-b", "6"]


def untrained_run(data_dir, save_dir, **kw):
    """An untrained 2L-2L model for the data's vocabulary, saved as a run."""
    data = PreparedData(data_dir)
    torch.manual_seed(0)
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=2, embed_dim=32, ffn_dim=64, attention_heads=4, dropout=0.0,
        src_vocab_size=data.src_vocab_size, tgt_vocab_size=data.tgt_vocab_size, **kw,
    )  # fmt: skip
    return write_run(Transformer(cfg), save_dir)


@pytest.fixture(scope="module")
def run(multi30k_slice, tmp_path_factory):
    return untrained_run(multi30k_slice, tmp_path_factory.mktemp("runs") / "run")


def source_lines(multi30k_slice, count=7):
    return (multi30k_slice / "test.raw.de").read_text(encoding="utf-8").split("\n")[:count]


def translate(capsys, monkeypatch, run, data, stdin: bytes, *args):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    translate_main(["--checkpoint", str(run), "--data", str(data), *SEARCH, *args])
    return capsys.readouterr()


@pytest.mark.slow
def test_the_python_api_translates_as_the_commands_do(capsys, monkeypatch, run, multi30k_slice):
    """Translator.from_checkpoint(...).translate(lines) from a notebook or a server, and translate_split
    for a prepared split: the same lines as translate.py and generate.py, with no command line to fake."""
    lines = source_lines(multi30k_slice)
    search = SearchConfig(beam=3, lenpen=0.6, max_len_a=0, max_len_b=6)
    translator = Translator.from_checkpoint(run, multi30k_slice, device="cpu", search=search)
    stdin = "".join(line + "\n" for line in lines).encode()
    assert (
        translator.translate(lines) == translate(capsys, monkeypatch, run, multi30k_slice, stdin).out.split("\n")[:-1]
    )
    split = translate_split(run, multi30k_slice, "test", device="cpu", search=search)
    generate_main(["--checkpoint", str(run), "--data", str(multi30k_slice), *SEARCH, "--output", str(run / "out.txt")])
    assert split.hypotheses == (run / "out.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert split.references == (multi30k_slice / "test.raw.en").read_text(encoding="utf-8").split("\n")[:-1]
    with pytest.raises(ConfigError, match="beam: must be at least 1, got 0"):
        Translator.from_checkpoint(run, multi30k_slice, search=SearchConfig(beam=0))


@pytest.mark.slow
def test_translations_keep_input_order_and_empty_lines(capsys, monkeypatch, run, multi30k_slice):
    """An empty line, and one a user sees as empty (whitespace, zero-width spaces and joiners), gives an
    empty line and is not decoded: a line of U+200B was decoded into a made-up sentence."""
    lines = source_lines(multi30k_slice)
    empty = {3: "", 5: "\u200b", 7: " \u200b\u2060\t"}
    for index, line in empty.items():
        lines.insert(index, line)
    stdin = "".join(line + "\n" for line in lines).encode()
    batched = translate(capsys, monkeypatch, run, multi30k_slice, stdin, "--batch-size", "3").out.split("\n")[:-1]
    alone = translate(capsys, monkeypatch, run, multi30k_slice, stdin, "--batch-size", "1").out.split("\n")[:-1]
    assert batched == alone and len(batched) == len(lines)
    assert [i for i, line in enumerate(batched) if not line] == list(empty)
    # each line alone gives its own line's translation
    first = translate(capsys, monkeypatch, run, multi30k_slice, (lines[6] + "\n").encode()).out
    assert first == batched[6] + "\n"


@pytest.mark.slow
def test_translate_equals_generate_on_a_prepared_split(capsys, monkeypatch, run, multi30k_slice, tmp_path):
    """Raw text through SentencePiece and the dictionary gives prepare_data's token ids: the same hypotheses
    and the same scores as generate.py on the binarized split."""
    generate_main(["--checkpoint", str(run), "--data", str(multi30k_slice), "--subset", "test", *SEARCH]
                  + ["--output", str(tmp_path / "generated.txt")])  # fmt: skip
    generated = capsys.readouterr().out.splitlines()
    args = ["--input", str(multi30k_slice / "test.raw.de"), "--output", str(tmp_path / "translated.txt")]
    args += ["--reference", str(multi30k_slice / "test.raw.en")]
    err = translate(capsys, monkeypatch, run, multi30k_slice, b"", *args).err.splitlines()
    assert (tmp_path / "translated.txt").read_text() == (tmp_path / "generated.txt").read_text()
    assert [line for line in err if line.startswith(("tokenized BLEU", "BLEU", "chrF2", "nrefs"))] == generated[1:]


def test_a_line_too_long_for_the_model_is_cut_with_one_warning(capsys, monkeypatch, multi30k_slice, tmp_path):
    run = untrained_run(multi30k_slice, tmp_path / "run", max_positions=24)
    long = " ".join(source_lines(multi30k_slice, 4))  # far over 24 positions
    result = translate(capsys, monkeypatch, run, multi30k_slice, f"Ein Hund.\n{long}\n".encode())
    assert len(result.out.splitlines()) == 2
    warnings = [line for line in result.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "line 2:" in warnings[0] and "cut to the model's 23" in warnings[0]


@pytest.mark.slow
def test_stdout_holds_only_translations(run, multi30k_slice):
    """Through the script, as a user pipes it: nothing but one translation a line on stdout (no library
    logging), and translating does not import DeepSpeed."""
    stdin = "".join(line + "\n" for line in source_lines(multi30k_slice, 3))
    code = "import runpy, sys; runpy.run_path('scripts/translate.py', run_name='__main__')"
    code += "; assert 'deepspeed' not in sys.modules"
    result = subprocess.run(
        [sys.executable, "-c", code, "--checkpoint", str(run), "--data", str(multi30k_slice), *SEARCH],
        cwd=ROOT, input=stdin, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 3 and "WARNING" not in result.stdout


def refused(capsys, monkeypatch, run, data, stdin: bytes, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        translate(capsys, monkeypatch, run, data, stdin, *args)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    "stdin, args, message",
    [
        (b"Ein Hund.\nein \xff Hund\n", [], "stdin:2: not valid UTF-8"),
        (b"", [], "stdin: no lines to translate"),
        (b"Ein Hund.\n", ["--beam", "0"], "--beam: must be at least 1, got 0"),
        (b"Ein Hund.\n", ["--batch-size", "0"], "--batch-size: must be at least 1"),
        (b"Ein Hund.\n", ["--max-len-b", "0"], "--max-len-b: must be at least 1"),
        (b"Ein Hund.\n", ["--max-len-a=-1"], "--max-len-a: must be at least 0, got -1.0"),
        (b"Ein Hund.\n", ["--lenpen", "inf"], "--lenpen: must be a finite number, got inf"),
        (b"Ein Hund.\n", ["--tag", "global_step7"], "no checkpoint tagged 'global_step7'"),
        (b"Ein Hund.\n", ["--input", "/nonexistent.de"], "--input /nonexistent.de: no such file"),
        (b"Ein Hund.\nZwei Hunde.\n", ["--reference", "REF"], "1 lines for 2 input lines"),
        (b"Ein Hund.\n", ["--precision", "fp16", "--device", "cpu"], "--precision fp16: needs a GPU"),
        (b"Ein Hund.\n", ["--device", "gpu0"], "--device gpu0: not a device"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(capsys, monkeypatch, run, multi30k_slice, tmp_path, stdin, args,
                                                  message):  # fmt: skip
    (tmp_path / "ref.en").write_text("A dog.\n")
    args = [str(tmp_path / "ref.en") if a == "REF" else a for a in args]
    err = refused(capsys, monkeypatch, run, multi30k_slice, stdin, *args, "--output", str(tmp_path / "out.en"))
    assert message in err
    assert not (tmp_path / "out.en").exists()


def test_a_data_directory_of_another_vocabulary_is_refused(capsys, monkeypatch, multi30k_slice, tmp_path):
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=8, ffn_dim=16, attention_heads=2,
                      src_vocab_size=40, tgt_vocab_size=40)  # fmt: skip
    other = write_run(Transformer(cfg), tmp_path / "other")
    err = refused(capsys, monkeypatch, other, multi30k_slice, b"Ein Hund.\n")
    assert "the model was trained with 40/40" in err


SEPARATORS = "\u2028\u2029\x85\x0c\x1c\x1d\x1e\x0b"  # str.splitlines splits on each; a corpus line may hold them


@pytest.mark.slow
def test_unicode_line_separators_stay_inside_their_line(capsys, monkeypatch, tmp_path):
    """Text is split on newlines only, from prepare_data to the references generate.py scores against and
    translate.py's input: a separator inside a line must not shift the references against the hypotheses."""
    raw = tmp_path / "raw"
    raw.mkdir()
    prefixes = [write_slice(raw, "train", 200), write_slice(raw, "test_2016_flickr", 12)]
    for lang in ("de", "en"):
        lines = (raw / f"test_2016_flickr.{lang}").read_text(encoding="utf-8").split("\n")[:-1]
        lines = [f"{line[:8]}{SEPARATORS[i % len(SEPARATORS)]}{line[8:]}" for i, line in enumerate(lines)]
        (raw / f"test_2016_flickr.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    data = tmp_path / "data"
    prepare_main(["--src", "de", "--tgt", "en", "--train", prefixes[0], "--valid", prefixes[1], "--test", prefixes[1]]
                 + ["--vocab-size", "300", "--out", str(data)])  # fmt: skip
    run = untrained_run(data, tmp_path / "run")
    args = parse_generate_args(["--checkpoint", str(run), "--data", str(data), "--subset", "test", *SEARCH])
    hypotheses, references, *_ = translate_split(run, data, "test", search=search_config(args))
    assert references == lines and len(hypotheses) == 12
    capsys.readouterr()
    stdin = (raw / "test_2016_flickr.de").read_bytes()
    assert len(translate(capsys, monkeypatch, run, data, stdin).out.split("\n")) == 12 + 1


# Each used to decode the whole split and then fail with a traceback (or, for NaN, score nonsense).
SPLIT_ARGS_REFUSED = [
    (generate_main, ["--lenpen", "nan"], "--lenpen: must be a finite number, got nan"),
    (generate_main, ["--max-len-a", "inf"], "--max-len-a: must be a finite number, got inf"),
    (generate_main, ["--output", "/"], "--output /: is a directory; name a file"),
    (generate_main, ["--output", "/proc/fathom.en"], "--output /proc/fathom.en: cannot write in /proc"),
    (generate_main, ["--output", "/no-dir/out.txt"], "/no-dir is not a directory; create it or choose another"),
    (bench_translate_main, ["--sentences", "-1"], "--sentences: must be at least 0 (0: the whole split), got -1"),
    (bench_translate_main, ["--json", "/proc/bench.json"], "--json /proc/bench.json: cannot write in /proc"),
    (bench_translate_main, ["--systems", "incremental,nope"], "--systems: unknown system 'nope'"),
    (generate_main, ["--tag", "../run/global_step1"], "--tag: '../run/global_step1' is not a tag"),  # read outside
    (generate_main, ["--tag", ""], "--tag: '' is not a tag"),  # read SAVE_DIR itself, blamed a truncated file
]


@pytest.mark.parametrize("main, args, message", SPLIT_ARGS_REFUSED, ids=[" ".join(c[1]) for c in SPLIT_ARGS_REFUSED])
def test_split_decoders_refuse_bad_arguments_before_decoding(capsys, run, multi30k_slice, main, args, message):
    """generate.py and bench_translate.py, which decode a prepared split."""
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(run), "--data", str(multi30k_slice), "--subset", "test", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_an_output_never_replaces_the_data_or_the_runs_records(capsys, run, multi30k_slice):
    """`generate.py --output RUN/config.json` replaced the run's config with hypotheses and exited 0 (the
    run was then unreadable); an output in the data directory lands among checksummed inputs."""
    files = [p for p in (*multi30k_slice.iterdir(), *run.iterdir()) if p.is_file()]
    before = {p: p.read_bytes() for p in files}
    tag = run / (run / "latest").read_text().strip()
    for output, message in (
        (run / "config.json", "would replace the training run's config.json; choose another file"),
        (run / "latest", "would replace the training run's latest"),
        (tag / "hypotheses.txt", f"inside the checkpoint {tag}"),
        (multi30k_slice / "test.raw.en", f"inside the prepared data directory {multi30k_slice}"),
    ):
        with pytest.raises(SystemExit) as exc:
            generate_main(["--checkpoint", str(run), "--data", str(multi30k_slice), *SEARCH, "--output", str(output)])
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert {p: p.read_bytes() for p in files} == before and not (tag / "hypotheses.txt").exists()


def test_a_damaged_run_directory_is_one_line(capsys, multi30k_slice, tmp_path):
    """Each was a traceback, or for `latest`, a checkpoint read from outside the run."""
    run = untrained_run(multi30k_slice, tmp_path / "run")
    args = ["--checkpoint", str(run), "--data", str(multi30k_slice), "--subset", "test"]
    config = (run / "config.json").read_text()
    for name, text, message in (
        ("latest", "../elsewhere/global_step1", "latest: names '../elsewhere/global_step1', not a tag"),
        ("config.json", '{"model": ', "config.json: not a run's config (JSONDecodeError"),
        ("config.json", '{"modl": {}}', "config.json: not a run's config (KeyError: 'model')"),
        ("config.json", config.replace('"embed_dim": 32', '"embed_dim": "x"'), "model.embed_dim: expected an integer"),
    ):
        before = (run / name).read_text()
        (run / name).write_text(text)
        with pytest.raises(SystemExit) as exc:
            generate_main(args)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
        (run / name).write_text(before)


def test_a_run_that_never_saved_says_so(capsys, monkeypatch, multi30k_slice, tmp_path):
    """It asked for `one of the global_step* folders` of a run that had none; a run with checkpoints but
    no `latest` names the tags to pass."""
    run = untrained_run(multi30k_slice, tmp_path / "run")
    (run / "latest").unlink()
    err = refused(capsys, monkeypatch, run, multi30k_slice, b"Ein Hund.\n")
    assert err.strip() == f"fathom: error: {run}: no 'latest' file; pass a tag, one of: global_step1"
    shutil.rmtree(run / "global_step1")
    err = refused(capsys, monkeypatch, run, multi30k_slice, b"Ein Hund.\n")
    assert f"{run}: no 'latest' file and no checkpoint: the run has not saved one yet" in err
    assert "train.save_interval" in err


def test_outputs_through_links_pipes_and_a_full_disk(capsys, monkeypatch, run, multi30k_slice, tmp_path):
    """The atomic write replaced whatever --output named: as root it turned /dev/full into a regular file
    (and exited 0), and it replaced a link with a file."""
    stdin = b"Ein Hund.\nZwei Hunde.\n"
    with pytest.raises(SystemExit) as exc:
        translate(capsys, monkeypatch, run, multi30k_slice, stdin, "--output", "/dev/full")
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 1 and err == "fathom: error: /dev/full: No space left on device", err
    assert Path("/dev/full").is_char_device() and not list(Path("/dev").glob(".full*"))
    target, link = tmp_path / "target.en", tmp_path / "link.en"
    target.write_text("old\n")
    link.symlink_to(target)
    translate(capsys, monkeypatch, run, multi30k_slice, stdin, "--output", str(link))
    assert link.is_symlink() and len(target.read_text().splitlines()) == 2
    pipe = tmp_path / "pipe.en"
    os.mkfifo(pipe)
    received = []
    reader = threading.Thread(target=lambda: received.append(pipe.read_text()))
    reader.start()
    translate(capsys, monkeypatch, run, multi30k_slice, stdin, "--output", str(pipe))
    reader.join(timeout=60)
    assert received == [target.read_text()] and pipe.is_fifo()


def test_an_output_is_never_one_of_the_commands_own_inputs(capsys, monkeypatch, run, multi30k_slice, tmp_path):
    """`translate.py --input same.de --output same.de` replaced the German with its translation and exited
    0; `--reference ref.en --output ref.en` printed BLEU, then replaced the references. However the output
    is spelled (relative, through a link, a hard link), it is refused before any decoding."""
    source, reference = tmp_path / "same.de", tmp_path / "ref.en"
    source.write_text("Ein Hund.\nZwei Hunde.\n")
    reference.write_text("A dog.\nTwo dogs.\n")
    (tmp_path / "link.de").symlink_to(source)
    os.link(reference, tmp_path / "hard.en")
    monkeypatch.chdir(tmp_path)
    before = {p: p.read_bytes() for p in (source, reference)}
    for output, what in (
        (str(source), f"--input {source}"),
        ("./same.de", f"--input {source}"),
        ("link.de", f"--input {source}"),
        (f"../{tmp_path.name}/ref.en", f"--reference {reference}"),
        ("hard.en", f"--reference {reference}"),
    ):
        err = refused(capsys, monkeypatch, run, multi30k_slice, b"", "--input", str(source),
                      "--reference", str(reference), "--output", output)  # fmt: skip
        assert f"--output {Path(output)}: is the same file as {what}, which it reads; choose another file" in err, err
    assert {p: p.read_bytes() for p in (source, reference)} == before
    references = multi30k_slice / "test.raw.en"  # generate.py's references, through a hard link outside the data
    os.link(references, tmp_path / "refs.en")
    with pytest.raises(SystemExit) as exc:
        generate_main(["--checkpoint", str(run), "--data", str(multi30k_slice), *SEARCH, "--output", "refs.en"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and f"--output refs.en: is the same file as the references {references}" in err, err


@pytest.mark.slow
def test_two_writers_of_one_output_both_finish_and_leave_one_whole_file(tmp_path):
    """write_atomic wrote every output through one fixed temporary name: two processes writing the same
    output renamed each other's file away (FileNotFoundError), e.g. two runs decoding into one file."""
    output, start = tmp_path / "out.txt", time.time() + 8  # both writing at once, once imported
    code = (
        "import sys, time; from pathlib import Path; from fathom.common.files import write_atomic\n"
        "time.sleep(max(0, float(sys.argv[3]) - time.time()))\n"
        "while time.time() < float(sys.argv[3]) + 2: write_atomic(Path(sys.argv[1]), sys.argv[2] * 20000)"
    )
    writers = [subprocess.Popen([sys.executable, "-c", code, str(output), mark, str(start)], cwd=ROOT,
                                stderr=subprocess.PIPE, text=True) for mark in "ab"]  # fmt: skip
    errors = [writer.communicate(timeout=120)[1] for writer in writers]
    assert [writer.returncode for writer in writers] == [0, 0], errors
    assert output.read_text() in ("a" * 20000, "b" * 20000)
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
