"""The depth study's machinery on a tiny grid (seconds per cell): every cell through the real launcher,
a cell made to diverge classified so, a killed study resumed without retraining finished cells, and
the report rebuilt from the cells' logs alone. The classification rules on hand-made logs; what a study
keeps across runs (baseline, training, evaluation) on training faked in-process."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fathom.corpus.dataset import read_meta
from fathom.pipeline.config.run_config import load_config
from fathom.study.classes import DIVERGED, STALLED, TRAINED, classify
from fathom.study.grid import (
    CELL_FILE,
    Grid,
    StudySpec,
    cell_config,
    cell_dir,
    cells,
    check_overrides,
    read_sittings,
    read_spec,
)
from fathom.study.report import cell_list, cell_summary, cpu_text, entry
from fathom.study.run import check, run
from fathom.study.run import main as study_main
from fathom.study.source_use import unigram_nll
from tests.helpers import ROOT, prepare_slice, wait_for_release, without_matplotlib

CONFIG = load_config(ROOT / "ds_configs" / "default.json", ["scheduler.params.warmup_num_steps=5"], world_size=2)


def steps(losses):
    return [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]


@pytest.mark.parametrize(
    "records, result, expected",
    [
        (steps([5.0, 4.0]), {"exit": 3}, (DIVERGED, "non-finite at step 3")),
        (steps([5.0, float("nan")]), {"exit": 0}, (DIVERGED, "non-finite loss at step 2")),
        (steps([5.0] * 10 + [4.0] * 10 + [9.0] * 5), {"exit": 0}, (DIVERGED, "ended above its start")),
        (steps([5.0, 4.0]), {"exit": 0, "valid_nll": 4.9, "shuffled_nll": 6.0}, (STALLED, "vs unigram 5.00")),
        (steps([5.0, 4.0]), {"exit": 0, "valid_nll": 3.0, "shuffled_nll": 3.05}, (STALLED, "ignores the source")),
        (steps([5.0, 4.0]), {"exit": 0, "valid_nll": 3.0, "shuffled_nll": 4.0}, (TRAINED, "validation loss 3.00")),
    ],
)
def test_classification(records, result, expected):
    label, why = classify(records, result, baseline=5.0, cfg=CONFIG)
    assert label == expected[0] and expected[1] in why, why


def test_the_grid_runs_shallow_cells_first_and_names_them():
    spec = StudySpec(config="c", out="o", schemes=["a", "b"], depths=[12, 6])
    assert [c.name for c in cells(spec)] == ["a-6L", "b-6L", "a-12L", "b-12L"]


def test_distinct_learning_rates_make_distinct_cells():
    """Cells were named with {lr:g}: 0.002 and 0.0020000001 shared pre_ln-1L-lr0.002-warmup2, so the second
    "resumed" the first at its last step, trained nothing, and the report showed two equal columns."""
    spec = StudySpec(
        config="ds_configs/default.json", out="o", schemes=["pre_ln"], depths=[6],
        grids=[Grid(depths=[1], schemes=["pre_ln"], lrs=[0.002, 0.0020000001, 5e-05], warmups=[2])],
    )  # fmt: skip
    names = [c.name for c in cells(spec)]
    assert names[1:] == ["pre_ln-1L-lr0.002-warmup2", "pre_ln-1L-lr0.0020000001-warmup2", "pre_ln-1L-lr5e-05-warmup2"]
    assert len({cell_dir(spec, c) for c in cells(spec)}) == len(names)


def test_a_grid_cell_at_the_base_settings_is_the_main_grids_run():
    """default.json trains at lr 0.001 with 50 warmup steps: a cell names only what differs from that, so
    the grid's pre_ln at lr 0.001 is pre_ln-6L, trained once."""
    spec = StudySpec(
        config="ds_configs/default.json", out="o", schemes=["pre_ln"], depths=[6],
        grids=[Grid(depths=[6], schemes=["pre_ln", "post_ln"], lrs=[0.001, 0.002], warmups=[50])],
    )  # fmt: skip
    assert [c.name for c in cells(spec)] == ["pre_ln-6L", "post_ln-6L", "pre_ln-6L-lr0.002", "post_ln-6L-lr0.002"]


SHIPPED_STUDIES = [
    p for p in sorted((ROOT / "ds_configs").glob("study_*.json")) if "schemes" in json.loads(p.read_text())
]


def test_a_study_finds_its_config_beside_it_or_shipped_by_name(tmp_path, monkeypatch):
    """From any directory: a shipped study by name, its base config beside it; a user's study file in its own
    folder naming a config there; a config not beside the spec is looked for as --config looks for it."""
    monkeypatch.chdir(tmp_path)

    def config(spec):
        return Path(read_spec(spec).config).resolve()

    assert config("study_multi30k") == ROOT / "ds_configs" / "study_multi30k_base.json"
    (tmp_path / "mine").mkdir()
    shutil.copy(ROOT / "ds_configs" / "default.json", tmp_path / "mine" / "base.json")
    study = {"config": "base.json", "out": "studies/mine", "schemes": ["pre_ln"], "depths": [2]}
    (tmp_path / "mine" / "study.json").write_text(json.dumps(study))
    assert config("mine/study.json") == tmp_path / "mine" / "base.json"
    (tmp_path / "mine" / "study.json").write_text(json.dumps({**study, "config": "default"}))
    assert config("mine/study.json") == ROOT / "ds_configs" / "default.json"


@pytest.mark.parametrize("path", SHIPPED_STUDIES, ids=lambda p: p.name)
def test_every_cell_of_a_shipped_study_is_a_valid_run(path, multi30k_slice):
    data = json.loads(path.read_text())
    spec = read_spec(path)
    spec.overrides.append(f"data.path={multi30k_slice}")
    check_overrides(spec, grid := cells(spec))
    for cell in grid:
        cfg = cell_config(spec, cell)
        assert (cfg.model.norm_scheme, cfg.model.encoder_layers, cfg.model.decoder_layers) == (
            cell.scheme, cell.depth, cell.depth,
        )  # fmt: skip
    assert len({cell_dir(spec, c) for c in grid}) == len(grid) >= len(data["schemes"]) * len(data["depths"])


def test_each_axis_sets_what_it_names(multi30k_slice):
    """Tokens per update through accumulation (the batch follows it, so DeepSpeed's check holds), the number
    of updates with the decaying schedule's end, clipping, a warmup of none, and a variant's overrides."""
    spec = StudySpec(
        config="ds_configs/study_multi30k_base.json", out="o", schemes=["branchnorm"], depths=[6],
        overrides=[f"data.path={multi30k_slice}"],
        grids=[Grid(schemes=["branchnorm"], depths=[6], clips=[0.0], accumulations=[8], updates=[1200], warmups=[0],
                    variants={"T48": ["model.branchnorm.T=48"]})],
    )  # fmt: skip
    cell = cells(spec)[-1]
    assert cell.name == "branchnorm-6L-warmup0-clip0-acc8-updates1200-T48"
    cfg = cell_config(spec, cell)
    ds = cfg.deepspeed
    assert (ds["gradient_clipping"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (0.0, 8, 8)
    assert cfg.train.max_steps == ds["scheduler"]["params"]["total_num_steps"] == 1200
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 1  # DeepSpeed raises it to its minimum of 2
    assert cfg.model.schemes["branchnorm"]["T"] == 48
    assert cell_config(spec, cells(spec)[0]).deepspeed["gradient_clipping"] == 1.0  # the base config's


def test_a_variant_of_no_overrides_is_the_base_configs_cell():
    """The base config's T as a column beside the variants, without training that run twice."""
    spec = StudySpec(
        config="ds_configs/study_multi30k_base.json", out="o", schemes=["branchnorm"], depths=[6],
        grids=[Grid(schemes=["branchnorm"], depths=[6], variants={"T10": [], "T3": ["model.branchnorm.T=3"]})],
    )  # fmt: skip
    assert [c.name for c in cells(spec)] == ["branchnorm-6L", "branchnorm-6L-T3"]


@pytest.mark.slow
def test_a_study_without_matplotlib_is_one_line_before_any_cell_trains(tmp_path, multi30k_slice):
    """Its report draws: the study trained for hours, then ended in a ModuleNotFoundError traceback."""
    path = write_study(tmp_path, multi30k_slice)
    for args in ([], ["--report"]):
        result = subprocess.run(
            [sys.executable, "scripts/depth_study.py", "--study", str(path), *args],
            cwd=ROOT, capture_output=True, text=True, env=without_matplotlib(tmp_path),
        )  # fmt: skip
        assert result.returncode == 2 and result.stderr.strip() == (
            "fathom: error: scripts/depth_study.py draws with matplotlib, which is not installed; "
            "pip install -e '.[plot]'"
        ), result.stderr
    assert not (tmp_path / "study").exists()


def write_study(tmp_path, data):
    study = {
        "config": "default",  # shipped, found by name
        "out": str(tmp_path / "study"),
        "schemes": ["pre_ln"],
        "depths": [1, 2],
        "overrides": [
            f"data.path={data}",
            "train.max_steps=12",
            "train.save_interval=3",
            "train.valid_interval=6",
            "model.embed_dim=32",
            "model.ffn_dim=64",
            "train.grad_norm_interval=2",
        ],  # fmt: skip
        # made to diverge; twice the base config's micro-batches an update
        "grids": [{"schemes": ["pre_ln"], "depths": [1], "lrs": [100.0], "warmups": [0], "accumulations": [8]}],
        "heatmap": "pre_ln-2L",
        "search": {"beam": 2},
    }
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    return path


def study(path, *args):
    command = [sys.executable, "scripts/depth_study.py", "--study", str(path), *args]
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


@pytest.mark.slow
def test_a_killed_study_resumes_and_reports_from_logs(tmp_path, multi30k_slice):
    path = write_study(tmp_path, multi30k_slice)
    spec = read_spec(path)
    first, second, third = (tmp_path / "study" / "cells" / c.name for c in cells(spec))
    killed = study(path)
    deadline = time.monotonic() + 300
    while not (first / CELL_FILE).exists() or not (second / "latest").exists():  # a checkpoint of cell 2
        if killed.poll() is not None or time.monotonic() > deadline:
            os.killpg(killed.pid, signal.SIGKILL)
            pytest.fail(f"the study ended or hung before cell 2's first checkpoint: {killed.communicate()[0][-3000:]}")
        time.sleep(0.1)
    os.killpg(killed.pid, signal.SIGKILL)  # the study and the cell's ranks, mid-cell
    killed.wait()
    wait_for_release(second)
    finished = (first / CELL_FILE).read_text()
    interim = study(path, "--report")  # a half-trained cell was reported as `not run`
    assert interim.wait(timeout=300) == 0, interim.communicate()[0][-3000:]
    logged = [r["step"] for r in map(json.loads, (second / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    row = next(line for line in (tmp_path / "study" / "report.md").read_text().splitlines() if "| pre_ln |" in line)
    assert f"| interrupted at step {logged[-1]} |" in row, row

    resumed = study(path)
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert "cell 1/3" not in output and "cell 2/3 pre_ln-2L: training" in output, output[-3000:]
    assert (first / CELL_FILE).read_text() == finished
    assert "resumed from" in (second.parent / "pre_ln-2L.log").read_text()  # from its checkpoint, not step 0
    sittings = read_sittings(spec, cells(spec)[1])
    assert [s["after_step"] > 0 for s in sittings] == [False, True], sittings  # and each start recorded
    trained = json.loads((second / CELL_FILE).read_text())["seconds"]  # the killed sitting's time counts
    assert sittings[0]["seconds"] > 0 and trained == pytest.approx(sittings[0]["seconds"] + sittings[1]["seconds"])
    summary = {s["cell"]: s for s in json.loads((tmp_path / "study" / "summary.json").read_text())}
    assert summary["pre_ln-1L-lr100-warmup0-acc8"]["class"] == DIVERGED
    assert {summary[c]["class"] for c in ("pre_ln-1L", "pre_ln-2L")} <= {TRAINED, STALLED}
    assert all("valid_nll" in summary[c] for c in ("pre_ln-1L", "pre_ln-2L"))
    assert (
        summary["pre_ln-1L-lr100-warmup0-acc8"]["tokens_per_update"] > 1.5 * summary["pre_ln-1L"]["tokens_per_update"]
    )
    assert summary["pre_ln-2L"]["cpus"] == [cpu_text(sittings[0])]  # one machine, named once
    assert third.exists()

    report = (tmp_path / "study" / "report.md").read_text()
    for name in ("report.md", "summary.json", "divergence_map.png", "grad_norm_heatmap.png"):
        (tmp_path / "study" / name).unlink()
    study_main(["--study", str(path), "--report"])  # in this process: the command's was run above
    assert (tmp_path / "study" / "report.md").read_text() == report
    assert (tmp_path / "study" / "grad_norm_heatmap.png").read_bytes()[:4] == b"\x89PNG"

    edit_study(path, heatmap=None)  # the last report's heatmap would pass for this one's
    study_main(["--study", str(path), "--report"])
    assert not (tmp_path / "study" / "grad_norm_heatmap.png").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"schemse": ["pre_ln"]}, "study.schemse: unknown key; did you mean 'schemes'?"),
        ({"schemes": ["deep_norm"]}, "model.norm_scheme: unknown scheme 'deep_norm'"),
        ({"depths": [0]}, "study.depths[0]: must be at least 1 (layers per side), got 0"),
        ({"overrides": ["modle.dropout=0.1"]}, "modle: neither a section of fathom's"),
        ({"overrides": ["model.encoder_layers=3"]}, "study.overrides: model.encoder_layers is set by each cell"),
        ({"out": " "}, "study.out: empty"),
        ({"search": {"beam": 0}}, "study.search.beam: must be at least 1, got 0"),
        ({"search": {"max_len_a": float("inf")}}, "study.search.max_len_a: must be a finite number, got inf"),
        ({"heatmap": "pre_ln-3L"}, "study.heatmap: pre_ln-3L is not a cell of this study"),
        ({"grids": [{"depths": [1], "schemes": ["pre_ln"], "lrs": []}]}, "study.grids[0].lrs: empty"),
        (
            {"grids": [{"depths": [1], "schemes": ["pre_ln"], "warmups": [-5]}]},
            "study.grids[0].warmups[0]: must be at least 0, got -5",
        ),
        (
            {"grids": [{"depths": [1], "schemes": ["pre_ln"], "accumulations": [0]}]},
            "study.grids[0].accumulations[0]: must be at least 1, got 0",
        ),
        (
            {"grids": [{"depths": [1], "schemes": ["pre_ln"], "clip": [0]}]},
            "study.grids[0].clip: unknown key; did you mean 'clips'?",
        ),
        (
            {"grids": [{"depths": [1], "schemes": ["pre_ln"], "clips": [0.0]}], "overrides": ["gradient_clipping=0.5"]},
            "study.overrides: gradient_clipping is set by each cell (cell pre_ln-1L-clip0 varies it)",
        ),
        (
            {"grids": [{"depths": [1], "schemes": ["pre_ln"], "variants": {"x": ["model.encoder_layers=2"]}}]},
            "study: variant x sets model.encoder_layers, which its grid sets; vary it there",
        ),
        (
            {
                "grids": [
                    {"depths": [1], "schemes": ["pre_ln"], "variants": {"x": ["model.dropout=0"]}},
                    {"depths": [2], "schemes": ["pre_ln"], "variants": {"x": ["model.dropout=0.3"]}},
                ]
            },
            "study.grids[1].variants.x: another grid names a variant x with other overrides",
        ),
        (
            {"grids": [{"depths": [1], "schemes": ["pre_ln"], "variants": {"a b": []}}]},
            "variants: 'a b'; name variants",
        ),
    ],
)
def test_a_bad_study_is_one_line_before_any_cell_trains(tmp_path, capsys, multi30k_slice, change, message):
    path = write_study(tmp_path, multi30k_slice)
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(SystemExit) as exc:
        study_main(["--study", str(path)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "study").exists()


def test_a_study_out_holding_prepared_data_is_refused(capsys, tmp_path, multi30k_slice):
    path = write_study(tmp_path, multi30k_slice)
    path.write_text(json.dumps({**json.loads(path.read_text()), "out": str(multi30k_slice)}))
    before = sorted(p.name for p in multi30k_slice.iterdir())
    with pytest.raises(SystemExit) as exc:
        study_main(["--study", str(path)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "is a prepared data directory; choose another for the study" in err, err
    assert sorted(p.name for p in multi30k_slice.iterdir()) == before


def test_a_cell_trained_under_other_settings_is_refused_not_mixed_in(tmp_path, capsys, multi30k_slice):
    """A study file or base config edited after some cells ran: resuming or reporting those cells would
    put runs of different settings in one table. Another scheme's settings do not count."""
    path = write_study(tmp_path, multi30k_slice)
    path.write_text(
        json.dumps(
            {**(study := json.loads(path.read_text())), "overrides": [*study["overrides"], "model.branchnorm.T=10"]}
        )
    )
    spec = read_spec(path)
    cell = cells(spec)[0]
    saved = check(spec, cells(spec))[cell].to_dict()  # what train.py writes: with the data's vocabulary
    saved["model"]["branchnorm"]["T"] = 100  # pre_ln does not read it
    cell_dir(spec, cell).mkdir(parents=True)
    (cell_dir(spec, cell) / "config.json").write_text(json.dumps(saved))
    check(spec, cells(spec))

    saved["model"]["dropout"] = 0.3
    (cell_dir(spec, cell) / "config.json").write_text(json.dumps(saved))
    for args in ([], ["--report"]):
        with pytest.raises(SystemExit) as exc:
            study_main(["--study", str(path), *args])
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1, err
        assert "cell pre_ln-1L was trained with model.dropout=0.3, the study now gives 0.1" in err, err
    assert sorted(p.name for p in (tmp_path / "study").iterdir()) == ["cells"]


@pytest.fixture(scope="module")
def other_slice(tmp_path_factory):
    """Another prepared slice of Multi30k (fewer pairs): another unigram baseline."""
    out = tmp_path_factory.mktemp("prepared") / "m30k-300"
    return prepare_slice(tmp_path_factory.mktemp("raw"), out, pairs=300, valid=40, test=30, vocab_size=300)


def fake_training(monkeypatch, status=0):
    """study.run.train_cell without a process: each cell's losses falling to train.max_steps and its
    `latest` checkpoint, as a run that ended writes them; returns the names of the cells it trained."""
    trained = []

    def train(spec, cell, cfg):
        directory = cell_dir(spec, cell)
        directory.mkdir(parents=True, exist_ok=True)
        records = [
            {"step": s, "loss": 6.0 - s / 4, "grad_norm": 1.0, "tokens": 100} for s in range(1, cfg.train.max_steps + 1)
        ]
        (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (directory / "latest").write_text(f"global_step{cfg.train.max_steps}")
        trained.append(cell.name)
        return status

    monkeypatch.setattr("fathom.study.run.train_cell", train)
    return trained


def fake_evaluation(monkeypatch):
    """Validation losses of a model that translates, and a BLEU; returns the cells it decoded."""
    decoded = []
    monkeypatch.setattr("fathom.study.run.valid_nlls", lambda save_dir, data: (3.0, 4.0))
    monkeypatch.setattr("fathom.study.run.bleu", lambda spec, cfg, save_dir: decoded.append(save_dir.name) or 30.0)
    return decoded


def run_study(path):
    """study.run.run as the study command calls it, without its report (which draws)."""
    spec = read_spec(path)
    run(spec, check(spec, cells(spec)))
    return spec


def edit_study(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def move_data(path, data, other):
    study = json.loads(path.read_text())
    edit_study(path, overrides=[f"data.path={other}", *study["overrides"][1:]])


def prepare_again(path, data, other):
    shutil.rmtree(data)
    shutil.copytree(other, data)


@pytest.mark.parametrize("change", [move_data, prepare_again])
def test_the_unigram_baseline_is_of_the_data_the_study_now_gives(
    tmp_path, monkeypatch, multi30k_slice, other_slice, change
):
    """baseline.json kept the unigram loss of the data the study first ran on (4.8058 against the new
    data's 4.8111) after data.path changed and the refused cell was retrained: every cell was classified
    against the wrong number."""
    data = tmp_path / "data"
    shutil.copytree(multi30k_slice, data)
    path = write_study(tmp_path, data)
    fake_training(monkeypatch, status=3)  # diverged: nothing to evaluate
    run_study(path)
    change(path, data, other_slice)
    shutil.rmtree(tmp_path / "study" / "cells")  # as the study's refusal says
    run_study(path)
    now = other_slice if change is move_data else data
    kept = json.loads((tmp_path / "study" / "baseline.json").read_text())
    assert kept["unigram_nll"] == unigram_nll(now) != unigram_nll(multi30k_slice)
    assert kept["data"] == {str(now): read_meta(now / "meta.json")["files"]}


def test_a_cell_trained_on_data_prepared_again_since_is_refused(
    tmp_path, capsys, monkeypatch, multi30k_slice, other_slice
):
    """Data prepared again at the study's data.path: a finished cell, trained on the old data, was
    reported beside cells trained on the new."""
    data = tmp_path / "data"
    shutil.copytree(multi30k_slice, data)
    path = write_study(tmp_path, data)
    fake_training(monkeypatch, status=3)
    run_study(path)
    prepare_again(path, data, other_slice)
    for args in ([], ["--report"]):
        with pytest.raises(SystemExit) as exc:
            study_main(["--study", str(path), *args])
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"study: cell pre_ln-1L was trained on other data than the study now gives ({data}/" in err, err
        assert f"remove {tmp_path / 'study' / 'cells' / 'pre_ln-1L'} to retrain that cell" in err, err


def test_a_cells_evaluation_is_made_again_when_what_it_was_made_with_changed(tmp_path, monkeypatch, multi30k_slice):
    """cell.json kept a cell's BLEU whatever the study's search settings became since."""
    path = write_study(tmp_path, multi30k_slice)
    trained, decoded = fake_training(monkeypatch), fake_evaluation(monkeypatch)
    spec = run_study(path)
    assert trained == decoded == [c.name for c in cells(spec)]
    trained.clear(), decoded.clear()
    run_study(path)
    assert trained == decoded == []  # nothing changed: nothing done again

    edit_study(path, search={"beam": 3})
    spec = read_spec(path)
    first = cells(spec)[0]
    assert entry(cell_summary(spec, first, 5.0)) == (
        "evaluating: training ended at step 12; evaluated with search.beam=2, the study now gives 3; the next run "
        "evaluates it"
    )
    run_study(path)
    assert trained == [] and decoded == [c.name for c in cells(spec)]
    assert entry(cell_summary(spec, first, 5.0)) == "trained: 3.00 / 4.00, BLEU 30.0"


def test_a_cell_stalled_when_evaluated_but_trained_by_other_margins_is_decoded(tmp_path, monkeypatch, multi30k_slice):
    """The margins are constants that --report reapplies: a cell that stalled when evaluated (so no BLEU)
    but trains by changed margins was a KeyError on its BLEU."""
    path = write_study(tmp_path, multi30k_slice)
    fake_training(monkeypatch)
    decoded = fake_evaluation(monkeypatch)
    monkeypatch.setattr("fathom.study.run.valid_nlls", lambda save_dir, data: (4.2, 5.0))  # unigram 4.48: stalled
    spec = run_study(path)
    assert decoded == []
    monkeypatch.setattr("fathom.study.classes.BASELINE_MARGIN", 0.1)
    assert entry(cell_summary(spec, cells(spec)[0], unigram_nll(multi30k_slice))) == (
        "evaluating: training ended at step 12; stalled when evaluated, so not decoded, but trained by today's "
        "margins; the next run evaluates it"
    )
    run_study(path)
    assert decoded == [c.name for c in cells(spec)]


def test_a_study_killed_while_evaluating_a_cell_reports_and_then_evaluates_it(tmp_path, monkeypatch, multi30k_slice):
    """A study killed during a cell's evaluation showed `interrupted at step 12` for a cell that had
    trained to the end, left it out of "Every cell", and its next run trained it again."""
    path = write_study(tmp_path, multi30k_slice)
    spec = read_spec(path)
    trained = fake_training(monkeypatch)

    def killed(save_dir, data):
        raise KeyboardInterrupt  # what the study sees of a kill, here during the first cell's evaluation

    monkeypatch.setattr("fathom.study.run.valid_nlls", killed)
    with pytest.raises(KeyboardInterrupt):
        run_study(path)
    first = cells(spec)[0]
    summaries = {cell: cell_summary(spec, cell, 5.0) for cell in cells(spec)}
    assert entry(summaries[first]) == (
        "evaluating: training ended at step 12; evaluation interrupted; the next run evaluates it"
    )
    assert "| pre_ln-1L | evaluating | - | - | 100 |" in cell_list(summaries)
    seconds = json.loads((cell_dir(spec, first) / CELL_FILE).read_text())["seconds"]

    fake_evaluation(monkeypatch)
    trained.clear()
    run_study(path)
    assert trained == [c.name for c in cells(spec)[1:]]  # the first cell is evaluated, not trained again
    result = json.loads((cell_dir(spec, first) / CELL_FILE).read_text())
    assert (result["valid_nll"], result["bleu"], result["seconds"]) == (3.0, 30.0, seconds)


def test_the_source_use_nll_is_the_models_per_token_nll():
    """study/source_use.py's nats per target token are model/loss.py's unsmoothed token losses (one rule), which
    equal torch's cross-entropy over the real tokens."""
    import torch
    import torch.nn.functional as F

    from fathom.corpus.batches import collate
    from fathom.model.model_config import PAD, ModelConfig
    from fathom.model.transformer import Transformer
    from fathom.study.source_use import nll

    torch.manual_seed(0)
    model = Transformer(ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=8, ffn_dim=16, attention_heads=2,
                                    src_vocab_size=30, tgt_vocab_size=30)).eval()  # fmt: skip
    pairs = [(torch.randint(4, 30, (n,)), torch.randint(4, 30, (n + 1,))) for n in (3, 5, 2)]
    (src, prev), target = collate(pairs)
    with torch.no_grad():
        expected = F.cross_entropy(model(src, prev).flatten(0, 1), target.flatten(), ignore_index=PAD).item()
    assert nll(model, pairs) == pytest.approx(expected, rel=1e-6)


def test_the_source_curve_measures_each_committed_checkpoint(tmp_path, multi30k_slice):
    """When a cell starts to read its source (round 3): its validation loss with real and shuffled sources at
    every checkpoint it committed, in step order, the last one its evaluation's own numbers."""
    import torch

    from fathom.corpus.dataset import BinarizedCorpus
    from fathom.model.model_config import ModelConfig
    from fathom.model.transformer import Transformer
    from fathom.study.source_use import nll, source_curve, valid_nlls, with_shuffled_sources
    from tests.helpers import write_run

    torch.manual_seed(0)
    valid = BinarizedCorpus(multi30k_slice, "valid")
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=8, ffn_dim=16, attention_heads=2,
                      src_vocab_size=valid.src_vocab_size, tgt_vocab_size=valid.tgt_vocab_size)  # fmt: skip
    models = {100: Transformer(cfg).eval(), 200: Transformer(cfg).eval()}
    for step, model in models.items():
        write_run(model, tmp_path / "run", step=step)
    curve = source_curve(tmp_path / "run", multi30k_slice)
    pairs, shuffled = with_shuffled_sources(valid)
    assert [point["step"] for point in curve] == list(models)
    assert [point["valid_nll"] for point in curve] == pytest.approx([nll(m, pairs) for m in models.values()])
    assert [point["shuffled_nll"] for point in curve] == pytest.approx([nll(m, shuffled) for m in models.values()])
    latest = valid_nlls(tmp_path / "run", multi30k_slice)
    assert (curve[-1]["valid_nll"], curve[-1]["shuffled_nll"]) == pytest.approx(latest)


def test_a_study_with_source_curves_evaluates_and_draws_them(tmp_path, monkeypatch, multi30k_slice):
    """`source_curve`: each cell's evaluation measures its checkpoints, takes the latest one's losses from
    that curve (not measured twice), and the report draws them per depth."""
    from fathom.study.report import write_report

    path = write_study(tmp_path, multi30k_slice)
    edit_study(path, source_curve=True)
    fake_training(monkeypatch), fake_evaluation(monkeypatch)
    measured = []
    curve = [{"step": 6, "valid_nll": 3.5, "shuffled_nll": 3.6}, {"step": 12, "valid_nll": 3.1, "shuffled_nll": 4.2}]
    monkeypatch.setattr("fathom.study.run.source_curve", lambda save_dir, data: measured.append(save_dir.name) or curve)
    monkeypatch.setattr("fathom.study.run.valid_nlls", lambda save_dir, data: pytest.fail("measured the latest twice"))
    spec = run_study(path)
    assert measured == [c.name for c in cells(spec)]
    for cell in cells(spec):
        record = json.loads((cell_dir(spec, cell) / CELL_FILE).read_text())
        assert record["source_curve"] == curve and (record["valid_nll"], record["shuffled_nll"]) == (3.1, 4.2)
    report = write_report(spec, 5.0).read_text()
    for depth in spec.depths:
        assert (tmp_path / "study" / f"source_curve_{depth}L.png").stat().st_size > 0
        assert f"![source_curve_{depth}L.png](source_curve_{depth}L.png)" in report
