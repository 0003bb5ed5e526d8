"""Held-out pairs against the length limits: a validation or test pair over --max-len is kept and
counted at preparation (as fairseq-preprocess keeps held-out pairs), and one over model.max_positions is
named at launch: a warning with sinusoidal positions, an error with learned ones, which cannot embed it."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from fathom.common.errors import ConfigError
from fathom.common.run_layout import META_FILE
from fathom.corpus.dataset import BinarizedCorpus
from fathom.corpus.prepare import main as prepare_main
from fathom.pipeline.launch.checks import check_run, parse_train_args
from tests.helpers import ROOT, write_slice

MAX_LEN = 40  # pieces, the training pairs' limit


@dataclass(frozen=True)
class Prepared:
    path: Path
    warnings: list[str]  # what preparing it said on stderr


@pytest.fixture(scope="module")
def long_valid_pair(tmp_path_factory) -> Prepared:
    """Prepared Multi30k pairs whose first validation pair is ten sentences run together."""
    raw = tmp_path_factory.mktemp("raw")
    train, valid = write_slice(raw, "train", 300), write_slice(raw, "val", 30)
    for lang in ("de", "en"):
        lines = (raw / f"val.{lang}").read_text(encoding="utf-8").splitlines()
        (raw / f"val.{lang}").write_text("\n".join([" ".join(lines[:10]), *lines[10:]]) + "\n", encoding="utf-8")
    out = tmp_path_factory.mktemp("prepared") / "data"
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        prepare_main(["--src", "de", "--tgt", "en", "--train", train, "--valid", valid, "--vocab-size", "300"]
                     + ["--max-len", str(MAX_LEN), "--workers", "1", "--out", str(out)])  # fmt: skip
    return Prepared(out, [line for line in stderr.getvalue().splitlines() if line.startswith("fathom:")])


def test_held_out_pairs_over_max_len_are_kept_and_counted(long_valid_pair):
    split = json.loads((long_valid_pair.path / META_FILE).read_text())["splits"]["valid"]
    longer = BinarizedCorpus(long_valid_pair.path, "valid").lengths() - 1  # pieces, without the eos
    assert split["pairs"] == 21 and split.get("kept_too_long") == int((longer > MAX_LEN).sum()) >= 1
    assert split["longest"] == longer.max() > 5 * MAX_LEN
    [warning] = long_valid_pair.warnings
    assert warning.startswith(
        f"fathom: warning: valid ({split['source']}): {split['kept_too_long']} of 21 pairs are longer than "
        f"--max-len {MAX_LEN} pieces (the longest {split['longest']}); kept"
    )


def launch_check(data: Path, tmp_path: Path, *overrides: str) -> None:
    args = parse_train_args(["--config", str(ROOT / "ds_configs" / "default.json"), "--override", f"data.path={data}",
                             f"train.save_dir={tmp_path / 'run'}", "train.valid_interval=10", *overrides])  # fmt: skip
    check_run(args, world_size=2)


def test_a_validation_pair_over_max_positions_is_named_at_launch(long_valid_pair, tmp_path, capsys):
    positions = MAX_LEN + 10  # every training pair fits (check_fits), the long validation pair does not
    launch_check(long_valid_pair.path, tmp_path, f"model.max_positions={positions}")
    lengths = BinarizedCorpus(long_valid_pair.path, "valid").lengths()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"fathom: warning: {int((lengths > positions).sum())} of 21 validation pairs are longer than "
        f"model.max_positions {positions} (the longest {lengths.max()} tokens): validation evaluates them at "
        "positions no training pair reaches, and they weigh on the validation loss; remove them from the raw "
        "valid split and prepare the data again"
    ]


def test_learned_positions_refuse_a_validation_pair_they_cannot_embed(long_valid_pair, tmp_path):
    with pytest.raises(ConfigError, match=r"^model.max_positions: \d+ of 21 validation pairs are longer than .*, past"):
        launch_check(long_valid_pair.path, tmp_path, f"model.max_positions={MAX_LEN + 10}", "model.learned_pos=true")
