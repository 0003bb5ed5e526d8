"""A depth study: norm schemes x depths, and further grids over learning rate, warmup, gradient clipping,
tokens per update and number of updates, on one prepared data set; one training run per cell through the
launcher and scripts/train.py, exactly as a user runs them.

    python scripts/depth_study.py --study ds_configs/study_multi30k.json [--report]

Every cell starts from the same experiment config (data order, batches, optimizer, schedule, seed) and
changes only what its grid varies (tools/study_grid.py). A cell is a run directory STUDY/cells/NAME; it
is finished once STUDY/cells/NAME/cell.json exists, so the same command again skips finished cells and
resumes an interrupted one from its last checkpoint. Each start of a cell's training (a sitting) is
recorded with the CPU it ran on. Each finished cell is classified from its own logs
(tools/study_report.py), and the report is rebuilt from them alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.errors import ConfigError, exit_on_config_error
from common.files import check_makeable, write_atomic
from common.ports import free_port
from common.run_layout import CONFIG_FILE, META_FILE, latest_tag
from corpus.dataset import BinarizedCorpus
from model.norms import SCHEMES
from pipeline.config.history import flat, read_back
from pipeline.config.run_config import RunConfig, read_json, with_vocab
from pipeline.safety.divergence import NONFINITE_EXIT
from tools.figures import pyplot
from tools.preparation_speed import cpu
from tools.source_use import unigram_nll, valid_nlls
from tools.study_grid import (
    BASELINE_FILE,
    CELL_FILE,
    ROOT,
    Cell,
    StudySpec,
    accumulation,
    cell_config,
    cell_dir,
    cell_overrides,
    cell_records,
    cells,
    check_overrides,
    read_baseline,
    read_cell,
    read_spec,
    sittings_path,
)
from tools.study_report import STUDY, TRAINED, classify, write_report

FIXED_DEPTH = 10  # default study: 6L-6L trained at 2,561 tok/s, 100L-100L at ~350; (100+10)/(6+10) = 6.9 vs 7.3


def command(spec: StudySpec, cell: Cell, cfg: RunConfig, port: int) -> list[str]:
    """What a user would type for this cell: scripts/launch.py (DeepSpeed's launcher, checked first)."""
    return [
        sys.executable, str(ROOT / "scripts" / "launch.py"), "--num_gpus", str(cfg.stages),
        "--master_port", str(port), str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / spec.config),
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
    with open(sittings_path(spec, cell), "a") as out:
        out.write(json.dumps(sitting) + "\n")
    with open(log, "a") as out:
        status = subprocess.run(command(spec, cell, cfg, free_port()), stdout=out, stderr=subprocess.STDOUT).returncode
    if status not in (0, NONFINITE_EXIT):
        tail = "".join(log.read_text().splitlines(keepends=True)[-5:]).strip()
        raise ConfigError(f"cell {cell.name}: training exited with status {status}; see {log}:\n{tail}")
    return status


def bleu_args(spec: StudySpec, data: str | Path, save_dir: Path) -> argparse.Namespace:
    """generate.py's arguments for a cell's validation BLEU: the study's beam, lenpen and length limit."""
    from translation.generate import parse_args

    search = spec.search
    return parse_args(["--checkpoint", str(save_dir), "--data", str(data), "--subset", "valid", "--beam",
                       str(search.beam), "--lenpen", str(search.lenpen), "--max-len-a", str(search.max_len_a),
                       "--max-len-b", str(search.max_len_b), "--batch-size", str(search.batch_size),
                       "--device", "cpu"])  # fmt: skip


def bleu(spec: StudySpec, cfg: RunConfig, save_dir: Path) -> float:
    """Validation BLEU of the run's latest checkpoint with the incremental beam search (generate.py's)."""
    from sacrebleu.metrics import BLEU

    from translation.generate import translate

    hypotheses, references, _ = translate(bleu_args(spec, cfg.data.directory, save_dir))
    return BLEU().corpus_score(hypotheses, [references]).score


def evaluate(spec: StudySpec, cell: Cell, cfg: RunConfig, status: int, seconds: float) -> dict[str, Any]:
    """What the report needs beyond the run's logs: the exit status, the training time, and for a cell
    that ended with weights, its validation loss with real and shuffled sources and, if it trained,
    its validation BLEU; and the seconds the evaluation took."""
    directory = cell_dir(spec, cell)
    record: dict[str, Any] = {"exit": status, "seconds": seconds}
    tick = time.monotonic()
    if status == 0 and latest_tag(directory) is not None:
        record["valid_nll"], record["shuffled_nll"] = valid_nlls(directory, Path(cfg.data.directory))
        if classify(cell_records(directory), record, read_baseline(spec), cfg)[0] == TRAINED:
            record["bleu"] = bleu(spec, cfg, directory)
    record["eval_seconds"] = time.monotonic() - tick
    return record


def write_baseline(spec: StudySpec, data: Path) -> None:
    path = Path(spec.out) / BASELINE_FILE
    if not path.exists():
        write_atomic(path, json.dumps({"data": str(data), "unigram_nll": unigram_nll(data)}, indent=2) + "\n")


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


def check(spec: StudySpec, grid: list[Cell]) -> dict[Cell, RunConfig]:
    """Everything a study is checked for before any cell trains; returns each cell's run config."""
    check_overrides(spec, grid)
    configs = {cell: cell_config(spec, cell) for cell in grid}
    paths = {tuple(cfg.data.shards) for cfg in configs.values()}
    if len(paths) != 1 or () in paths:
        raise ConfigError(
            f"study: every cell needs the same prepared data.path; the cells have {sorted(map(list, paths))}"
        )
    data = paths.pop()[0]
    corpus = BinarizedCorpus(data, "train")
    for cell, cfg in configs.items():
        cfg.model = with_vocab(cfg.model, corpus)
        check_unchanged(spec, cell, cfg)
    if spec.heatmap is not None and spec.heatmap not in (names := [cell.name for cell in grid]):
        raise ConfigError(f"study.heatmap: {spec.heatmap} is not a cell of this study; choose one of {names}")
    out = Path(spec.out)
    check_makeable(out, "study.out")
    if (out / META_FILE).exists():
        raise ConfigError(f"study.out: {out} is a prepared data directory; choose another for the study")
    return configs


def micro_batches(cfg: RunConfig) -> int:
    return cfg.train.max_steps * accumulation(cfg)


def run(spec: StudySpec) -> None:
    """Trains and evaluates every unfinished cell in order, one line per cell start and end."""
    grid = cells(spec)
    configs = check(spec, grid)
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    write_baseline(spec, Path(next(iter(configs.values())).data.directory))
    # Seconds per unit of (depth + FIXED_DEPTH) x micro-batches, from the cells finished so far: the
    # estimate of the time left. The fixed part stands for what every cell pays whatever its depth
    # (start-up, the embeddings and output projection, evaluation).
    cost = {cell: (cell.depth + FIXED_DEPTH) * micro_batches(configs[cell]) for cell in grid}
    done = {cell: r for cell in grid if (r := read_cell(spec, cell)) is not None}
    for number, cell in enumerate(grid, 1):
        if cell in done:
            continue
        print(f"study: cell {number}/{len(grid)} {cell.name}: training", flush=True)
        tick = time.monotonic()
        status = train_cell(spec, cell, configs[cell])
        seconds = time.monotonic() - tick
        done[cell] = evaluate(spec, cell, configs[cell], status, seconds)
        write_atomic(cell_dir(spec, cell) / CELL_FILE, json.dumps(done[cell], indent=2) + "\n")
        rate = sum(r["seconds"] + r.get("eval_seconds", 0) for r in done.values()) / sum(cost[c] for c in done)
        left = sum(cost[c] for c in grid if c not in done) * rate
        print(f"study: cell {number}/{len(grid)} {cell.name}: ended ({'diverged' if status else 'finished'}) after "
              f"{duration(seconds)}; about {duration(left)} left", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", required=True, help="the study's JSON (ds_configs/study_*.json)")
    parser.add_argument("--report", action="store_true", help="only rebuild the report from the cells' logs")
    args = parser.parse_args(argv)
    with exit_on_config_error():
        pyplot(STUDY)  # the report draws: missing, found before hours of training
        spec = read_spec(args.study)
        if args.report:
            check(spec, cells(spec))
            if not (Path(spec.out) / BASELINE_FILE).exists():
                raise ConfigError(f"study.out: {spec.out} has no finished cell yet; run the study without --report")
        else:
            run(spec)
        print(f"study: report written to {write_report(spec)}")
