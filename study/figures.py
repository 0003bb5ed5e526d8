"""A depth study's figures, drawn from the cells' logs and evaluations (study/report.py lists them)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from fathom.common.figures import pyplot
from fathom.common.jsonl import read_jsonl
from fathom.common.run_layout import GRAD_NORMS_FILE
from fathom.study.classes import DIVERGED, SOURCE_MARGIN, STALLED, TRAINED
from fathom.study.grid import Cell, StudySpec, cell_dir, cell_records, combinations, grid_cell

STUDY = "scripts/depth_study.py"  # what draws, for the line saying matplotlib is missing


def divergence_map(spec: StudySpec, summaries: dict[Cell, dict[str, Any] | None], out: Path) -> None:
    depths = sorted(spec.depths)
    colors = {TRAINED: 2, STALLED: 1, DIVERGED: 0}
    grid = [[colors.get((summaries[Cell(s, d)] or {}).get("class"), math.nan) for d in depths] for s in spec.schemes]
    plt = pyplot(STUDY)
    fig, ax = plt.subplots(figsize=(1.4 * len(depths) + 2, 0.6 * len(spec.schemes) + 1.5))
    cmap = plt.matplotlib.colors.ListedColormap(["#d62728", "#ffbf00", "#2ca02c"])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=2)
    for i, scheme in enumerate(spec.schemes):
        for j, depth in enumerate(depths):
            summary = summaries[Cell(scheme, depth)]
            ax.text(j, i, summary["class"] if summary else "-", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [f"{d}L-{d}L" for d in depths])
    ax.set_yticks(range(len(spec.schemes)), spec.schemes)
    ax.set_title("which scheme trains at which depth")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def loss_curves(spec: StudySpec, out: Path) -> None:
    depths = sorted(spec.depths)
    plt = pyplot(STUDY)
    fig, axes = plt.subplots(1, len(depths), figsize=(3.2 * len(depths), 3.2), squeeze=False, sharey=True)
    for ax, depth in zip(axes[0], depths, strict=True):
        for color, scheme in enumerate(spec.schemes):  # a scheme keeps its colour in every panel
            valid = [r for r in cell_records(cell_dir(spec, Cell(scheme, depth))) if "valid_loss" in r]
            if valid:
                steps, losses = [r["step"] for r in valid], [r["valid_loss"] for r in valid]
                ax.plot(steps, losses, "o-", ms=3, color=f"C{color}", label=scheme)
        ax.set_title(f"{depth}L-{depth}L")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (label-smoothed, nats per token)")
    if drawn := [ax for ax in axes[0] if ax.lines]:
        drawn[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def early_steps(spec: StudySpec, out: Path, steps: int = 300) -> None:
    """BranchNorm paper Fig. 3's analogue: gradient norm and loss per step early on, deepest depth."""
    depth = max(spec.depths)
    plt = pyplot(STUDY)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for color, scheme in enumerate(spec.schemes):
        records = [r for r in cell_records(cell_dir(spec, Cell(scheme, depth))) if "loss" in r][:steps]
        style = {"lw": 0.8, "color": f"C{color}", "label": scheme}
        if records:
            top.plot([r["step"] for r in records], [r["grad_norm"] for r in records], **style)
            bottom.plot([r["step"] for r in records], [r["loss"] for r in records], **style)
    top.set_yscale("log")
    top.set_ylabel("gradient norm (before clipping)")
    bottom.set_ylabel("training loss")
    bottom.set_xlabel("step")
    top.set_title(f"the first {steps} steps at {depth}L-{depth}L")
    if top.lines:
        top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def heatmap(spec: StudySpec, out: Path) -> bool:
    """Per-layer gradient norms over steps of the chosen cell (its grad_norms.jsonl); False if none."""
    path = Path(spec.out) / "cells" / str(spec.heatmap) / GRAD_NORMS_FILE
    if spec.heatmap is None or not path.exists():
        return False
    records = read_jsonl(path)
    names = list(records[0]["norms"])
    grid = [[math.log10(max(r["norms"][n], 1e-12)) for r in records] for n in names]
    plt = pyplot(STUDY)
    fig, ax = plt.subplots(figsize=(8, 0.04 * len(names) + 2.5))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(0, len(records), max(1, len(records) // 8)),
                  [str(records[i]["step"]) for i in range(0, len(records), max(1, len(records) // 8))])  # fmt: skip
    ticks = [i for i, name in enumerate(names) if not name[-1].isdigit() or name.endswith(".0")]
    ax.set_yticks(ticks, [names[i] for i in ticks], fontsize=7)  # where each stack starts
    ax.set_xlabel("step")
    ax.set_ylabel("layer (pipeline order)")
    ax.set_title(f"{spec.heatmap}: log10 gradient norm per layer")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def source_gap(spec: StudySpec, summaries: dict[Cell, dict[str, Any] | None], out: Path) -> bool:
    """How much the real source helps (validation loss with shuffled sources minus with real ones)
    against the measured tokens per update, one line per scheme and depth of each grid that varies
    accumulation; False if no such grid has finished cells."""
    plt = pyplot(STUDY)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for grid in (g for g in spec.grids if g.accumulations):
        for depth, scheme in itertools.product(sorted(grid.depths), grid.schemes):
            points = sorted(
                (s["tokens_per_update"], s["shuffled_nll"] - s["valid_nll"])
                for c in combinations(grid)
                if (s := summaries[grid_cell(spec, scheme, depth, c)]) and "valid_nll" in s
            )
            if points:
                color = f"C{spec.schemes.index(scheme) if scheme in spec.schemes else len(spec.schemes)}"
                style = "o-" if depth == min(grid.depths) else "s--"
                ax.plot(*zip(*points, strict=True), style, color=color, label=f"{scheme} {depth}L-{depth}L")
    drawn = bool(ax.lines)
    if drawn:
        ax.axhline(SOURCE_MARGIN, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("target tokens per update (measured mean)")
        ax.set_ylabel("shuffled - real validation loss (nats)")
        ax.set_title("does the decoder read the source? (dotted: the 'trained' margin)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out, dpi=120)
    plt.close(fig)
    return drawn


def source_curves(spec: StudySpec, summaries: dict[Cell, dict[str, Any] | None], out: Path) -> list[str]:
    """Per depth of the main grid, validation loss and how much the real source helps (shuffled - real) at
    each checkpoint the cells' evaluations measured, one line per scheme: when a cell starts to read the
    source. The files drawn (source_curve_{depth}L.png in `out`)."""
    drawn = []
    for depth in sorted(spec.depths):
        curves = {s: c for s in spec.schemes if (c := (summaries[Cell(s, depth)] or {}).get("source_curve"))}
        name = f"source_curve_{depth}L.png"
        (out / name).unlink(missing_ok=True)  # an earlier report's would pass for this one's
        if not curves:
            continue
        plt = pyplot(STUDY)
        fig, (loss, gap) = plt.subplots(1, 2, figsize=(9, 3.5))
        for scheme, curve in curves.items():
            steps = [point["step"] for point in curve]
            style = {"color": f"C{spec.schemes.index(scheme)}", "label": scheme, "ms": 3}
            loss.plot(steps, [point["valid_nll"] for point in curve], "o-", **style)
            gap.plot(steps, [point["shuffled_nll"] - point["valid_nll"] for point in curve], "o-", **style)
        gap.axhline(SOURCE_MARGIN, color="grey", lw=0.8, ls=":")
        loss.set_ylabel("validation loss (nats per token)")
        gap.set_ylabel("shuffled - real validation loss (nats)")
        for ax in (loss, gap):
            ax.set_xlabel("update")
            ax.grid(alpha=0.3)
        loss.set_title(f"{depth}L-{depth}L: validation loss")
        gap.set_title("source gap (dotted: the 'trained' margin)")
        gap.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        drawn.append(name)
    return drawn
