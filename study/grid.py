"""A depth study's grid: what the study file says (StudySpec), the cells it makes, and each cell's run
directory, config and records. study/run.py runs the cells; study/report.py reads them.

The main grid is schemes x depths. Each further grid (`grids`) is schemes x depths x its axes: learning
rates, warmups, gradient clippings, gradient accumulations (tokens per update at the same memory),
numbers of updates, and named variants (sets of overrides). A cell names only the settings in which
it differs from the study's base config, so one run is never made twice: a grid cell at the base
settings is the main grid's cell.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from fathom.common.errors import ConfigError
from fathom.common.jsonl import read_jsonl
from fathom.common.run_layout import META_FILE, METRICS_FILE, committed_tags, latest_tag
from fathom.common.sections import bounds, parse_section
from fathom.corpus.dataset import read_meta
from fathom.model.search import SearchConfig
from fathom.pipeline.config.config_file import config_file, read_json
from fathom.pipeline.config.run_config import RunConfig, check_no_tilde, load_config

CELLS = "cells"
CELL_FILE = "cell.json"  # written when a cell's training has ended, then again with its evaluation
TRAINING = ("exit", "seconds", "data")  # what cell.json keeps of the training; the rest is the evaluation's
SITTINGS = ".sittings.jsonl"  # STUDY/cells/NAME.sittings.jsonl: one line per start of the cell's training
BASELINE_FILE = "baseline.json"  # the target unigram baseline, with the data it was computed from
VARIANT_NAME = re.compile(r"[A-Za-z0-9_.]+")


@dataclass(frozen=True)
class Axis:
    """One setting a grid can vary: its key in the study file, its tag in cell names, its value in a
    config, and the overrides that set it."""

    key: str
    tag: str
    read: Callable[[RunConfig], float]
    sets: Callable[[float, RunConfig], list[str]]


def scheduler_params(cfg: RunConfig) -> dict[str, Any]:
    scheduler = cfg.settings.scheduler
    return {} if scheduler is None else scheduler.params


def warmup_steps(cfg: RunConfig) -> int:
    """The warmup the base config's scheduler applies (its own default where the config gives none); 0
    without a scheduler or warmup."""
    scheduler = cfg.settings.scheduler
    return 0 if scheduler is None or scheduler.warmup_num_steps is None else int(scheduler.warmup_num_steps)


def micro_batches_per_update(cfg: RunConfig) -> int:
    """Micro-batches per update: a study's cells run one replica (as many ranks as stages)."""
    return cfg.settings.accumulation(replicas=1)


def set_lr(lr: float, cfg: RunConfig) -> list[str]:
    return [f"optimizer.params.lr={lr}", f"scheduler.params.warmup_max_lr={lr}"]


def set_warmup(steps: float, cfg: RunConfig) -> list[str]:
    # 0 means none: DeepSpeed's warmup schedulers take at least 2 steps whatever they are given
    return [f"scheduler.params.warmup_num_steps={max(1, int(steps))}"]


def set_clip(clip: float, cfg: RunConfig) -> list[str]:
    return [f"gradient_clipping={clip}"]


def set_accumulation(steps: float, cfg: RunConfig) -> list[str]:
    micro = cfg.settings.micro_batch_size
    return [f"gradient_accumulation_steps={int(steps)}", f"train_batch_size={int(steps) * micro}"]


def set_updates(steps: float, cfg: RunConfig) -> list[str]:
    # a decaying schedule ends where the run does, as the base config's does
    decays = "total_num_steps" in scheduler_params(cfg)
    return [f"train.max_steps={int(steps)}", *([f"scheduler.params.total_num_steps={int(steps)}"] if decays else [])]


AXES = (
    Axis("lrs", "lr", lambda cfg: cfg.settings.optimizer.lr, set_lr),
    Axis("warmups", "warmup", warmup_steps, set_warmup),
    Axis("clips", "clip", lambda cfg: cfg.settings.gradient_clipping, set_clip),
    Axis("accumulations", "acc", micro_batches_per_update, set_accumulation),
    Axis("updates", "updates", lambda cfg: cfg.train.max_steps, set_updates),
)
AXIS = {axis.key: axis for axis in AXES}
DEPTHS = bounds(1, what=" (layers per side)")


@dataclass
class Grid:
    """Each scheme at each depth and each combination of the axes given (None: the base config's)."""

    schemes: list[str]
    depths: list[int] = field(metadata=DEPTHS)
    title: str = ""  # the report's heading for the grid's table
    lrs: list[float] | None = field(default=None, metadata=bounds(0))
    # steps; 0 means none (DeepSpeed's shortest warmup, 2 steps)
    warmups: list[int] | None = field(default=None, metadata=bounds(0))
    clips: list[float] | None = field(default=None, metadata=bounds(0))  # gradient_clipping; 0 means none
    # gradient_accumulation_steps: tokens per update
    accumulations: list[int] | None = field(default=None, metadata=bounds(1))
    updates: list[int] | None = field(
        default=None, metadata=bounds(1)
    )  # train.max_steps (and a decaying schedule's end)
    # name -> overrides, e.g. {"T48": ["model.branchnorm.T=48"]}; no overrides names the base config's column
    variants: dict[str, list[str]] | None = None

    def check(self, where: str) -> None:
        for key in ("schemes", "depths", *(axis.key for axis in AXES), "variants"):
            if getattr(self, key) is not None and not getattr(self, key):
                raise ConfigError(f"{where}.{key}: empty; give at least one, or remove the key")
        for name, changes in (self.variants or {}).items():
            if not VARIANT_NAME.fullmatch(name):
                raise ConfigError(f"{where}.variants: {name!r}; name variants with letters, digits, '_' and '.'")
            if not isinstance(changes, list) or not all(isinstance(c, str) for c in changes):
                raise ConfigError(f"{where}.variants.{name}: expected a list of overrides, got {changes!r}")

    def axes(self) -> list[tuple[str, list]]:
        """(key, values) of each axis the grid varies, in AXES order, variants last."""
        varied = [(axis.key, values) for axis in AXES if (values := getattr(self, axis.key))]
        return varied + ([("variants", list(self.variants))] if self.variants else [])


@dataclass
class StudySpec:
    # The experiment config every cell starts from: a path relative to the spec's folder or, where none is
    # there, to the working directory, or a shipped config's name; read_spec resolves it to a file.
    config: str
    out: str  # the study directory
    schemes: list[str]
    depths: list[int] = field(metadata=DEPTHS)  # encoder = decoder layers
    overrides: list[str] = field(default_factory=list)  # for every cell, as --override takes them
    grids: list[Grid] = field(default_factory=list)
    # How trained cells' validation BLEU is decoded (generate.py's search)
    search: SearchConfig = field(default_factory=lambda: SearchConfig(lenpen=0.6))
    heatmap: str | None = None  # the cell whose per-layer gradient norms the report draws
    # Each cell's evaluation also measures the source's use at every checkpoint the cell committed (its
    # train.save_interval apart), which the report draws against updates, per depth
    source_curve: bool = False

    def __post_init__(self) -> None:
        if not self.out.strip():
            raise ConfigError("study.out: empty; name the study's directory, e.g. studies/multi30k")
        check_no_tilde(self.out, "study.out")
        if not self.schemes or not self.depths:
            raise ConfigError("study: give at least one scheme and one depth")
        variants: dict[str, list[str]] = {}
        for number, grid in enumerate(self.grids):
            grid.check(f"study.grids[{number}]")
            for name, changes in (grid.variants or {}).items():
                if variants.setdefault(name, changes) != changes:
                    raise ConfigError(
                        f"study.grids[{number}].variants.{name}: another grid names a variant {name} with other "
                        "overrides; give each its own name"
                    )

    def main_grid(self) -> Grid:
        return Grid(self.schemes, self.depths)


def number_text(value: float) -> str:
    """A setting as cell names and the report spell it: short (0.002, 100), and exact where the short
    form would name another value too (0.0020000001), so distinct settings never share a cell."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


@dataclass(frozen=True)
class Cell:
    scheme: str
    depth: int
    settings: tuple[tuple[str, float], ...] = ()  # (axis key, value) where it differs from the base, AXES order
    variant: str | None = None

    @property
    def name(self) -> str:
        name = f"{self.scheme}-{self.depth}L" + "".join(f"-{AXIS[k].tag}{number_text(v)}" for k, v in self.settings)
        return name + (f"-{self.variant}" if self.variant else "")


def read_spec(path: str | Path) -> StudySpec:
    """The spec at `path` or, where no such file exists, the one fathom ships under that name."""
    path = config_file(path)
    spec = parse_section(StudySpec, read_json(path), "study")
    beside = path.parent / spec.config
    return replace(spec, config=str(beside if beside.is_file() else config_file(spec.config)))


@cache
def _base_config(config: str, overrides: tuple[str, ...]) -> RunConfig:
    return load_config(config, list(overrides), world_size=None)


def base_config(spec: StudySpec) -> RunConfig:
    """The study's base config with its overrides: what every cell runs where its grid says nothing."""
    return _base_config(spec.config, tuple(spec.overrides))


def grid_cell(spec: StudySpec, scheme: str, depth: int, combination: dict[str, Any]) -> Cell:
    """The cell of one scheme, depth and combination of axis values; values equal to the base config's,
    and a variant of no overrides (a column for the base), are left out of it, so that run is the same
    cell wherever a grid names it."""
    given = [axis for axis in AXES if axis.key in combination]
    base = base_config(spec) if given else None
    settings = tuple((a.key, combination[a.key]) for a in given if combination[a.key] != a.read(base))
    variant = combination.get("variants")
    return Cell(scheme, depth, settings, variant if variant and variant_overrides(spec, variant) else None)


def combinations(grid: Grid) -> list[dict[str, Any]]:
    keys = [key for key, _ in grid.axes()]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(v for _, v in grid.axes()))]


def grid_cells(spec: StudySpec, grid: Grid) -> list[Cell]:
    """A grid's cells, shallow first, then by combination, then by scheme."""
    return list(
        dict.fromkeys(
            grid_cell(spec, scheme, depth, combination)
            for depth in sorted(grid.depths)
            for combination in combinations(grid)
            for scheme in grid.schemes
        )
    )


def cells(spec: StudySpec) -> list[Cell]:
    """The main grid by depth, then each further grid in the study file's order: a study's first answers
    come early and the deepest main-grid cells before any further grid."""
    return list(dict.fromkeys(cell for grid in [spec.main_grid(), *spec.grids] for cell in grid_cells(spec, grid)))


def cell_dir(spec: StudySpec, cell: Cell) -> Path:
    return Path(spec.out) / CELLS / cell.name


def variant_overrides(spec: StudySpec, variant: str) -> list[str]:
    return next(grid.variants[variant] for grid in spec.grids if variant in (grid.variants or {}))


def grid_overrides(spec: StudySpec, cell: Cell) -> list[str]:
    """What the cell's place in the grid sets: its scheme, depth, axis values and run directory."""
    changes = [f"model.norm_scheme={cell.scheme}", f"model.encoder_layers={cell.depth}",
               f"model.decoder_layers={cell.depth}", f"train.save_dir={cell_dir(spec, cell)}"]  # fmt: skip
    for key, value in cell.settings:
        changes += AXIS[key].sets(value, base_config(spec))
    return changes


def override_key(change: str) -> str:
    return change.partition("=")[0].strip()


def check_overrides(spec: StudySpec, grid: list[Cell]) -> None:
    """A study override or a variant of a key the grid sets would be silently replaced: refused."""
    for cell in grid:
        owned = {override_key(change) for change in grid_overrides(spec, cell)}
        for change in spec.overrides:
            if (key := override_key(change)) in owned:
                raise ConfigError(f"study.overrides: {key} is set by each cell (cell {cell.name} varies it); remove it")
        for change in variant_overrides(spec, cell.variant) if cell.variant else []:
            if (key := override_key(change)) in owned:
                raise ConfigError(f"study: variant {cell.variant} sets {key}, which its grid sets; vary it there")


def cell_overrides(spec: StudySpec, cell: Cell) -> list[str]:
    """The study's overrides, then the cell's variant, then what its place in the grid sets."""
    variant = variant_overrides(spec, cell.variant) if cell.variant else []
    return [*spec.overrides, *variant, *grid_overrides(spec, cell)]


def cell_config(spec: StudySpec, cell: Cell) -> RunConfig:
    """The cell's run config, checked as train.py checks it."""
    return load_config(spec.config, cell_overrides(spec, cell), world_size=None)


def read_cell(spec: StudySpec, cell: Cell) -> dict[str, Any] | None:
    path = cell_dir(spec, cell) / CELL_FILE
    return json.loads(path.read_text()) if path.exists() else None


def cell_records(directory: Path) -> list[dict[str, Any]]:
    path = directory / METRICS_FILE
    return read_jsonl(path) if path.exists() else []


def sittings_path(spec: StudySpec, cell: Cell) -> Path:
    return cell_dir(spec, cell).parent / f"{cell.name}{SITTINGS}"  # beside the log, for the same reason


def read_sittings(spec: StudySpec, cell: Cell) -> list[dict[str, Any]]:
    path = sittings_path(spec, cell)
    return read_jsonl(path) if path.exists() else []


def training(result: dict[str, Any]) -> dict[str, Any]:
    """What a cell.json keeps of the cell's training, without its evaluation."""
    return {key: result[key] for key in TRAINING if key in result}


def evaluation_inputs(spec: StudySpec, cell: Cell) -> dict[str, Any]:
    """What a cell's evaluation is made from beside its data: the checkpoint, the search of its BLEU, and
    with `source_curve` every checkpoint measured."""
    inputs = {"checkpoint": latest_tag(cell_dir(spec, cell)), "search": asdict(spec.search)}
    return {**inputs, "curve": committed_tags(cell_dir(spec, cell))} if spec.source_curve else inputs


def data_record(paths: list[str]) -> dict[str, Any]:
    """Each prepared directory with the size and SHA-256 of each of its files, as its meta.json records
    them (prepare_data wrote them; training verifies the files against them): what a cell trained on."""
    return {path: read_meta(Path(path) / META_FILE).get("files") for path in paths}


def changed_data(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first directory or file of data record `before` that `now` lacks or records otherwise (or the
    first that only `now` has); None for the same data."""

    def entries(record: dict[str, Any]) -> dict[str, Any]:
        files = {f"{path}/{name}": item for path, names in record.items() for name, item in (names or {}).items()}
        return {**dict.fromkeys(record, "directory"), **files}

    old, new = entries(before), entries(now)
    return next((name for name in [*old, *new] if old.get(name) != new.get(name)), None)
