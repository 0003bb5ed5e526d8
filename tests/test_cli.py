"""The helper commands: one-line errors from generate.py, a plot from plot_metrics.py."""

import json
import os
import subprocess
import sys

import pytest

from fathom.model import SCHEMES, ModelConfig, Transformer
from fathom.translation.generate import main as generate_main
from tests.helpers import ROOT, without_matplotlib, write_run


def run_generate(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        generate_main(list(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_generate_rejects_a_directory_that_is_not_a_run(tmp_path, capsys, multi30k_slice):
    err = run_generate(capsys, "--checkpoint", str(tmp_path), "--data", str(multi30k_slice))
    assert "not a training directory (no config.json)" in err


def test_generate_names_a_wrong_checkpoint_before_its_output(tmp_path, capsys, multi30k_slice):
    """It blamed the default output file inside the missing directory."""
    err = run_generate(capsys, "--checkpoint", str(tmp_path / "missing"), "--data", str(multi30k_slice))
    assert "missing: not a training directory (no config.json)" in err


def test_generate_rejects_an_unknown_subset_and_data_dir(tmp_path, capsys, multi30k_slice):
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=8, ffn_dim=8, attention_heads=2,
                      src_vocab_size=20, tgt_vocab_size=20)  # fmt: skip
    run = write_run(Transformer(cfg), tmp_path / "run")
    assert "no split 'dev'" in run_generate(
        capsys, "--checkpoint", str(run), "--data", str(multi30k_slice), "--subset", "dev"
    )
    assert "not a prepared data directory" in run_generate(capsys, "--checkpoint", str(run), "--data", str(tmp_path))


def plot_metrics(run, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/plot_metrics.py", str(run), *args], cwd=ROOT, capture_output=True, text=True
    )


@pytest.mark.slow
@pytest.mark.parametrize("torn", [False, True])
def test_plot_metrics_writes_a_png(tmp_path, torn):
    """A crash while rank 0 appends a line leaves it cut short: the plot leaves it out, with a warning."""
    rows = [{"step": s, "loss": 5.0 / s} for s in range(1, 21)] + [{"step": 10, "valid_loss": 0.7}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + ('{"step": 21, "lo' if torn else ""))
    result = plot_metrics(tmp_path)
    assert result.returncode == 0, result.stderr
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    warnings = [line for line in result.stderr.splitlines() if "fathom: warning:" in line]
    assert len(warnings) == int(torn) and all("line 22 is cut short" in w for w in warnings), result.stderr


@pytest.mark.slow
def test_plot_metrics_refuses_a_log_damaged_before_its_end(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo\n{"step": 3, "loss": 4.0}\n')
    result = plot_metrics(tmp_path)
    assert result.returncode == 2 and not (tmp_path / "loss.png").exists()
    log = tmp_path / "metrics.jsonl"
    assert result.stderr.strip() == (
        f"fathom: error: {log}: line 2 is not a JSON record; the log is damaged: remove that line"
    )


@pytest.mark.slow
@pytest.mark.parametrize("text", ["", '{"step": 1, "lo', '{"step": 1, "valid_loss": 5.0}\n'])
def test_plot_metrics_refuses_a_run_with_no_step_logged(tmp_path, text):
    """It drew empty axes and exited 0: a run that had not logged yet looked like one that learned nothing."""
    (tmp_path / "metrics.jsonl").write_text(text)
    result = plot_metrics(tmp_path)
    err = [line for line in result.stderr.splitlines() if "warning" not in line]
    assert result.returncode == 2 and len(err) == 1 and "no training step logged yet" in err[0], result.stderr
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.slow
def test_the_documented_scheme_table_is_the_registrys():
    result = subprocess.run([sys.executable, "scripts/list_schemes.py"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n| `") == len(SCHEMES) > 7
    table = ROOT / "docs" / "SCHEMES.md"
    assert result.stdout.strip() in table.read_text(), f"regenerate {table}'s table with this script"


@pytest.mark.slow
def test_plot_metrics_refuses_an_output_it_cannot_write(tmp_path):
    """Each was a traceback after plotting, and /dev/full an exit 0 with nothing written."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    for out, message in (
        (tmp_path, "is a directory; name a file"),
        (tmp_path / "missing" / "loss.png", "is not a directory; create it or choose another"),
        (tmp_path / "loss.txt", "not an image file name; end it in .png, .pdf or .svg"),
    ):
        result = plot_metrics(tmp_path, "--out", str(out))
        assert result.returncode == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1
    result = plot_metrics(tmp_path, "--out", str(tmp_path / "loss.PDF"))
    assert result.returncode == 0 and (tmp_path / "loss.PDF").read_bytes()[:5] == b"%PDF-"


@pytest.mark.slow
def test_plot_metrics_never_writes_over_the_log_it_plots(tmp_path):
    """However --out is spelled: here a hard link to metrics.jsonl, named like an image."""
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 5.0}\n')
    os.link(log, tmp_path / "same.png")
    result = plot_metrics(tmp_path, "--out", str(tmp_path / "same.png"))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"fathom: error: --out {tmp_path / 'same.png'}: is the same file as the run's log {log}, which it reads; "
        "choose another file"
    ), result.stderr
    assert log.read_text() == '{"step": 1, "loss": 5.0}\n'


@pytest.mark.slow
def test_plot_metrics_without_matplotlib_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    result = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, env=without_matplotlib(tmp_path))  # fmt: skip
    assert result.returncode == 2 and result.stderr.strip() == (
        "fathom: error: scripts/plot_metrics.py draws with matplotlib, which is not installed; pip install -e '.[plot]'"
    ), result.stderr
