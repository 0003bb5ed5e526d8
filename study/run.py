"""A depth study: norm schemes x depths, and further grids over learning rate, warmup, gradient clipping,
tokens per update and number of updates, on one prepared data set; one training run per cell through the
launcher and scripts/train.py, exactly as a user runs them.

    python scripts/depth_study.py --study ds_configs/study_multi30k.json [--report]

Every cell starts from the same experiment config (data order, batches, optimizer, schedule, seed) and
changes only what its grid varies (study/grid.py). A cell is a run directory STUDY/cells/NAME; its
training has ended once STUDY/cells/NAME/cell.json exists, so the same command again skips those cells
and resumes an interrupted one from its last checkpoint. Each start of a cell's training (a sitting) is
recorded with the CPU it ran on and how long it ran (updated every SITTING_TICK seconds, so a killed
study loses at most that of it); a cell's training time is its sittings'. Each finished cell is
classified from its own logs (study/report.py), and the report is rebuilt from them alone.

What a study keeps across runs records what it was computed from, and is computed again, or refused,
when that differs: baseline.json (the data's path and checksums: computed again), a cell's training
(cell.json's data: refused), a cell's evaluation (cell.json's checkpoint and search settings: made
again; the report shows the cell as `evaluating` until then). The report and its figures are drawn anew
each time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.figures import matplotlib_module
from fathom.common.files import write_atomic
from fathom.common.machine import cpu
from fathom.common.outputs import check_makeable
from fathom.common.ports import free_port
from fathom.common.run_layout import CONFIG_FILE, META_FILE, latest_step, latest_tag
from fathom.corpus.dataset import BinarizedCorpus
from fathom.model.norms import SCHEMES
from fathom.pipeline.config.config_file import read_json
from fathom.pipeline.config.history import read_back
from fathom.pipeline.config.resume_rules import flat
from fathom.pipeline.config.run_config import DataConfig, RunConfig
from fathom.pipeline.config.run_data import with_vocab
from fathom.pipeline.safety.divergence import NONFINITE_EXIT
from fathom.study.classes import TRAINED, classify
from fathom.study.figures import STUDY
from fathom.study.grid import (
    BASELINE_FILE,
    CELL_FILE,
    Cell,
    StudySpec,
    cell_config,
    cell_dir,
    cell_overrides,
    cell_records,
    cells,
    changed_data,
    check_overrides,
    data_record,
    evaluation_inputs,
    micro_batches_per_update,
    read_cell,
    read_sittings,
    read_spec,
    sittings_path,
    training,
)
from fathom.study.report import evaluation_due, write_report
from fathom.study.source_use import source_curve, unigram_nll, valid_nlls

SITTING_TICK = 10  # seconds between updates of a sitting's time: the most a killed study loses of it
FIXED_DEPTH = 10  # default study: 6L-6L trained at 2,561 tok/s, 100L-100L at ~350; (100+10)/(6+10) = 6.9 vs 7.3


def command(spec: StudySpec, cell: Cell, cfg: RunConfig, port: int) -> list[str]:
    """What a user would type for this cell, `fathom-launch ... --module fathom.train ...` (DeepSpeed's
    launcher, checked first), run by this interpreter so that it trains with this fathom, installed or not."""
    return [
        sys.executable, "-m", "fathom.pipeline.launch.command", "--num_gpus", str(cfg.stages),
        "--master_port", str(port), "--module", "fathom.train", "--config", spec.config,
        "--override", *cell_overrides(spec, cell), "--resume",
    ]  # fmt: skip


def train_cell(spec: StudySpec, cell: Cell, cfg: RunConfig) -> int:
    """Trains (or resumes) the cell to train.max_steps; its output goes to STUDY/cells/NAME.log. Returns
    the exit status: 0 finished, 3 stopped by a non-finite loss; anything else stops the study."""
    directory = cell_dir(spec, cell)
    directory.parent.mkdir(parents=True, exist_ok=True)
    log = directory.parent / f"{cell.name}.log"  # beside the run: train.py makes and may remove the run
    steps = [r["step"] for r in cell_records(directory) if "loss" in r]
    sitting = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "after_step": steps[-1] if steps else 0, **cpu()}
    before, path, tick = read_sittings(spec, cell), sittings_path(spec, cell), time.monotonic()

    def record_time() -> None:
        sitting["seconds"] = time.monotonic() - tick
        write_atomic(path, "".join(json.dumps(s) + "\n" for s in [*before, sitting]))

    with open(log, "a") as out:
        status = run_recording(command(spec, cell, cfg, free_port()), out, record_time)
    if status not in (0, NONFINITE_EXIT):
        tail = "".join(log.read_text().splitlines(keepends=True)[-5:]).strip()
        raise ConfigError(f"cell {cell.name}: training exited with status {status}; see {log}:\n{tail}")
    return status


def run_recording(argv: list[str], out: IO[str], record: Callable[[], None]) -> int:
    """Runs `argv` with its output to `out`, calling `record` at its start, every SITTING_TICK seconds and
    at its end; returns its exit status."""
    with subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT) as process:
        while True:
            record()
            if process.poll() is not None:
                return process.returncode
            try:
                process.wait(timeout=SITTING_TICK)
            except subprocess.TimeoutExpired:
                pass


def training_seconds(sittings: list[dict[str, Any]]) -> float:
    """A cell's training time: its sittings' since its last start from step 0 (a cell removed and trained
    again starts over). A sitting of an older fathom recorded no time and counts none."""
    fresh = [number for number, sitting in enumerate(sittings) if sitting["after_step"] == 0]
    return sum(sitting.get("seconds", 0.0) for sitting in sittings[fresh[-1] if fresh else 0 :])


def bleu(spec: StudySpec, cfg: RunConfig, save_dir: Path) -> float:
    """Validation BLEU of the run's latest checkpoint with the incremental beam search (generate.py's), with
    the study's search settings."""
    from fathom.common.bleu import corpus_bleu
    from fathom.translation.generate import translate_split

    split = translate_split(save_dir, cfg.data.directory, "valid", device="cpu", search=spec.search)
    return corpus_bleu(split.hypotheses, split.references, split.lang)


def train(spec: StudySpec, cell: Cell, cfg: RunConfig, data: dict[str, Any]) -> dict[str, Any]:
    """Trains the cell and writes what its cell.json keeps of the training: the exit status, the time of
    all its sittings and the data it trained on (`data`, a data record). Written before the evaluation,
    so a study killed during it keeps them, and its next run evaluates the cell instead of training it
    again."""
    status = train_cell(spec, cell, cfg)
    result = {"exit": status, "seconds": training_seconds(read_sittings(spec, cell)), "data": data}
    write_atomic(cell_dir(spec, cell) / CELL_FILE, json.dumps(result, indent=2) + "\n")
    return result


def evaluate(spec: StudySpec, cell: Cell, cfg: RunConfig, result: dict[str, Any], baseline: float) -> dict[str, Any]:
    """The cell's cell.json with what the report needs beyond the run's logs: what the evaluation was made
    of, for a cell that ended with weights its validation loss with real and shuffled sources (with the
    study's source_curve, at each checkpoint too) and, if it trained (by the unigram `baseline`), its
    validation BLEU; and the seconds the evaluation took."""
    directory = cell_dir(spec, cell)
    record = {**training(result), "evaluated": evaluation_inputs(spec, cell)}
    tick = time.monotonic()
    if record["exit"] == 0 and latest_tag(directory) is not None:
        data = Path(cfg.data.directory)
        if spec.source_curve:  # the curve's point at the latest step is the pair valid_nlls would measure
            record["source_curve"] = curve = source_curve(directory, data)
            (latest,) = [point for point in curve if point["step"] == latest_step(directory)]
            record["valid_nll"], record["shuffled_nll"] = latest["valid_nll"], latest["shuffled_nll"]
        else:
            record["valid_nll"], record["shuffled_nll"] = valid_nlls(directory, data)
        if classify(cell_records(directory), record, baseline, cfg)[0] == TRAINED:
            record["bleu"] = bleu(spec, cfg, directory)
    record["eval_seconds"] = time.monotonic() - tick
    write_atomic(directory / CELL_FILE, json.dumps(record, indent=2) + "\n")
    return record


def unigram_baseline(spec: StudySpec, data: Path) -> float:
    """The target unigram baseline of `data`, kept in STUDY/baseline.json with the data record it was
    computed from, and computed again (seconds) when the study's data is not that any more."""
    path, computed_from = Path(spec.out) / BASELINE_FILE, data_record([str(data)])
    kept = json.loads(path.read_text()) if path.exists() else {}
    if kept.get("data") == computed_from:
        return kept["unigram_nll"]
    nll = unigram_nll(data)
    write_atomic(path, json.dumps({"data": computed_from, "unigram_nll": nll}, indent=2) + "\n")
    if kept:
        print(f"study: unigram baseline of {data}: {nll:.4f}, computed again (baseline.json had "
              f"{kept['unigram_nll']:.4f}, not of this data as it is now)", flush=True)  # fmt: skip
    return nll


def duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def check_unchanged(spec: StudySpec, cell: Cell, cfg: RunConfig) -> None:
    """A cell already (partly) trained under other settings would be resumed or reported as if it had
    this study's: refused. Keys only one side has (added to fathom since) and the settings of other
    schemes, which this cell's model does not read, are not compared."""
    path = cell_dir(spec, cell) / CONFIG_FILE
    if not path.exists():
        return
    before, now = flat(read_json(path)), flat(read_back(cfg.to_dict()))
    ignored = tuple(f"model.{scheme}." for scheme in SCHEMES if scheme != cell.scheme)
    for key in sorted(before.keys() & now.keys()):
        if before[key] != now[key] and not key.startswith(ignored):
            raise ConfigError(
                f"study: cell {cell.name} was trained with {key}={json.dumps(before[key])}, the study now gives "
                f"{json.dumps(now[key])}; restore it, choose a new study.out, or remove {cell_dir(spec, cell)} to "
                "retrain that cell"
            )


def check_same_data(spec: StudySpec, cell: Cell, data: dict[str, Any]) -> None:
    """A cell whose training ended on other data than the study's `data` (a data record) now, moved or
    prepared again in place, would be reported beside cells of that data: refused. A cell.json of an
    older fathom recorded no data; its config's data.path is all there is to compare."""
    result = read_cell(spec, cell)
    if result is not None and "data" in result and (changed := changed_data(result["data"], data)):
        raise ConfigError(
            f"study: cell {cell.name} was trained on other data than the study now gives ({changed} differs); "
            f"restore the data, choose a new study.out, or remove {cell_dir(spec, cell)} to retrain that cell"
        )


def study_data(configs: dict[Cell, RunConfig]) -> DataConfig:
    """The data section every cell shares (check makes sure they do)."""
    return next(iter(configs.values())).data


def check(spec: StudySpec, grid: list[Cell]) -> dict[Cell, RunConfig]:
    """Everything a study is checked for before any cell trains; returns each cell's run config."""
    check_overrides(spec, grid)
    configs = {cell: cell_config(spec, cell) for cell in grid}
    paths = {tuple(cfg.data.shards) for cfg in configs.values()}
    if len(paths) != 1 or () in paths:
        raise ConfigError(
            f"study: every cell needs the same prepared data.path; the cells have {sorted(map(list, paths))}"
        )
    shards = list(paths.pop())
    corpus, record = BinarizedCorpus(shards[0], "train"), data_record(shards)
    for cell, cfg in configs.items():
        cfg.model = with_vocab(cfg.model, corpus)
        check_unchanged(spec, cell, cfg)
        check_same_data(spec, cell, record)
    if spec.heatmap is not None and spec.heatmap not in (names := [cell.name for cell in grid]):
        raise ConfigError(f"study.heatmap: {spec.heatmap} is not a cell of this study; choose one of {names}")
    out = Path(spec.out)
    check_makeable(out, "study.out")
    if (out / META_FILE).exists():
        raise ConfigError(f"study.out: {out} is a prepared data directory; choose another for the study")
    return configs


def micro_batches(cfg: RunConfig) -> int:
    return cfg.train.max_steps * micro_batches_per_update(cfg)


def run(spec: StudySpec, configs: dict[Cell, RunConfig]) -> None:
    """Trains every cell whose training has not ended and evaluates every cell whose evaluation is due,
    in order (`configs`: check's), one line per cell start and end."""
    grid = list(configs)
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    data = study_data(configs)
    baseline, record = unigram_baseline(spec, Path(data.directory)), data_record(data.shards)
    # Seconds per unit of (depth + FIXED_DEPTH) x micro-batches, from the cells trained so far: the
    # estimate of the time left. The fixed part stands for what every cell pays whatever its depth
    # (start-up, the embeddings and output projection, evaluation).
    cost = {cell: (cell.depth + FIXED_DEPTH) * micro_batches(configs[cell]) for cell in grid}
    done = {cell: r for cell in grid if (r := read_cell(spec, cell)) is not None}
    for number, cell in enumerate(grid, 1):
        cfg, name = configs[cell], f"study: cell {number}/{len(grid)} {cell.name}"
        if cell not in done:
            print(f"{name}: training", flush=True)
            done[cell] = train(spec, cell, cfg, record)
        elif due := evaluation_due(spec, cell, done[cell], baseline, cfg):
            print(f"{name}: evaluating ({due})", flush=True)
        else:
            continue
        result = done[cell] = evaluate(spec, cell, cfg, done[cell], baseline)
        rate = sum(r["seconds"] + r.get("eval_seconds", 0) for r in done.values()) / sum(cost[c] for c in done)
        left = sum(cost[c] for c in grid if c not in done) * rate
        print(f"{name}: {'diverged' if result['exit'] else 'finished'}, trained in {duration(result['seconds'])}, "
              f"evaluated in {duration(result['eval_seconds'])}; about {duration(left)} left", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(__doc__)
    parser.add_argument("--study", required=True, help="the study's JSON (ds_configs/study_*.json)")
    parser.add_argument("--report", action="store_true", help="only rebuild the report from the cells' logs")
    args = parser.parse_args(argv)
    with exit_on_config_error():
        spec = read_spec(args.study)
        configs = check(spec, cells(spec))
        matplotlib_module(STUDY)  # the report draws: missing, found before hours of training
        if args.report:
            if not (Path(spec.out) / BASELINE_FILE).exists():
                raise ConfigError(f"study.out: {spec.out} has no finished cell yet; run the study without --report")
        else:
            run(spec, configs)
        baseline = unigram_baseline(spec, Path(study_data(configs).directory))
        print(f"study: report written to {write_report(spec, baseline)}")
