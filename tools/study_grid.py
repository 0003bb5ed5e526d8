"""A depth study's grid: what the study file says (StudySpec), the cells it makes (schemes x depths, and
the sensitivity grid's learning rates x warmups at one depth), and each cell's run directory and config.
tools/study.py runs the cells; tools/study_report.py reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from model.config import ConfigError, parse_section
from pipeline.config import RunConfig, check_no_tilde, load_config, read_json

ROOT = Path(__file__).resolve().parents[1]
CELLS = "cells"


@dataclass
class Sensitivity:
    """A second grid at one depth: each scheme at each learning rate and warmup."""

    depth: int
    schemes: list[str]
    lrs: list[float]
    warmups: list[int]  # warmup steps; 0 means none (DeepSpeed's shortest warmup, 2 steps)

    def __post_init__(self) -> None:
        for key in ("schemes", "lrs", "warmups"):
            if not getattr(self, key):
                raise ConfigError(f"study.sensitivity.{key}: empty; give at least one, or remove the sensitivity grid")
        if min(self.warmups) < 0:
            raise ConfigError(f"study.sensitivity.warmups: {min(self.warmups)}; warmups are steps, at least 0")


@dataclass
class StudySpec:
    config: str  # the experiment config every cell starts from (relative to the repository root)
    out: str  # the study directory
    schemes: list[str]
    depths: list[int]  # encoder = decoder layers
    overrides: list[str] = field(default_factory=list)  # for every cell, as --override takes them
    sensitivity: Sensitivity | None = None
    beam: int = 4  # the validation BLEU of trained cells
    lenpen: float = 0.6
    # Output length limit a x source length + b: an undertrained model that never ends a sentence
    # would otherwise run every hypothesis to generate.py's default of 200 tokens.
    max_len_a: float = 1.2
    max_len_b: int = 10
    heatmap: str | None = None  # the cell whose per-layer gradient norms the report draws

    def __post_init__(self) -> None:
        if not self.out.strip():
            raise ConfigError("study.out: empty; name the study's directory, e.g. studies/multi30k")
        check_no_tilde(self.out, "study.out")
        if not self.schemes or not self.depths:
            raise ConfigError("study: give at least one scheme and one depth")
        for depth in [*self.depths, *([self.sensitivity.depth] if self.sensitivity else [])]:
            if depth < 1:
                raise ConfigError(f"study: depth {depth}; depths are layers per side, at least 1")


def lr_text(lr: float) -> str:
    """The learning rate as cell names and the report spell it: short (0.002, 100), and exact where the
    short form would name another rate too (0.0020000001), so distinct rates never share a cell."""
    short = f"{lr:g}"
    return short if float(short) == lr else repr(lr)


@dataclass(frozen=True)
class Cell:
    scheme: str
    depth: int
    lr: float | None = None  # None: the config's
    warmup: int | None = None

    @property
    def name(self) -> str:
        name = f"{self.scheme}-{self.depth}L"
        if self.lr is not None:
            name += f"-lr{lr_text(self.lr)}"
        if self.warmup is not None:
            name += f"-warmup{self.warmup}"
        return name

    def overrides(self) -> list[str]:
        changes = [  # a change to GRID_KEYS below goes with one here
            f"model.norm_scheme={self.scheme}",
            f"model.encoder_layers={self.depth}",
            f"model.decoder_layers={self.depth}",
        ]
        if self.lr is not None:
            changes += [f"optimizer.params.lr={self.lr}", f"scheduler.params.warmup_max_lr={self.lr}"]
        if self.warmup is not None:  # DeepSpeed's warmup takes at least 2 steps whatever it is given
            changes.append(f"scheduler.params.warmup_num_steps={max(1, self.warmup)}")
        return changes


# What a cell sets itself: a study's own overrides of these would be silently replaced.
GRID_KEYS = ("model.norm_scheme", "model.encoder_layers", "model.decoder_layers", "optimizer.params.lr",
             "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps", "train.save_dir")  # fmt: skip


def read_spec(path: str | Path) -> StudySpec:
    return parse_section(StudySpec, read_json(path), "study")


def warmup_steps(cfg: RunConfig) -> int:
    return int(cfg.deepspeed.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0))


def base_schedule(spec: StudySpec) -> tuple[float, int]:
    """The learning rate and warmup steps of every cell the sensitivity grid does not change."""
    cfg = load_config(ROOT / spec.config, spec.overrides, world_size=None)
    return cfg.deepspeed["optimizer"]["params"]["lr"], warmup_steps(cfg)


def sensitivity_cell(spec: StudySpec, scheme: str, lr: float, warmup: int, base: tuple[float, int]) -> Cell:
    """The sensitivity grid's cell; where it has the base lr and warmup at a main-grid depth it is the
    main grid's cell, so that run is not made twice."""
    assert spec.sensitivity is not None
    depth = spec.sensitivity.depth
    if (lr, warmup) == base and depth in spec.depths and scheme in spec.schemes:
        return Cell(scheme, depth)
    return Cell(scheme, depth, lr, warmup)


def cells(spec: StudySpec) -> list[Cell]:
    """The main grid by depth, then the sensitivity grid: shallow cells first, so a study's first
    answers come early and the deepest cells, which cost most, come last."""
    grid = [Cell(scheme, depth) for depth in sorted(spec.depths) for scheme in spec.schemes]
    if s := spec.sensitivity:
        base = base_schedule(spec)
        grid += [sensitivity_cell(spec, scheme, lr, w, base) for scheme in s.schemes for lr in s.lrs for w in s.warmups]
    return list(dict.fromkeys(grid))


def cell_dir(spec: StudySpec, cell: Cell) -> Path:
    return Path(spec.out) / CELLS / cell.name


def cell_overrides(spec: StudySpec, cell: Cell) -> list[str]:
    return [*spec.overrides, *cell.overrides(), f"train.save_dir={cell_dir(spec, cell)}"]


def cell_config(spec: StudySpec, cell: Cell) -> RunConfig:
    """The cell's run config, checked as train.py checks it."""
    return load_config(ROOT / spec.config, cell_overrides(spec, cell), world_size=None)
