"""A depth study's report, from the cells' own logs alone (study/run.py): each cell's class
(study/classes.py) and results in the grids' tables, the figures (study/figures.py), and every cell listed.

A cell whose evaluation is not the one to report (the study was killed while evaluating it, or the
evaluation was made of another checkpoint or with other search settings than the study's now) is
reported as `evaluating` with what its training logged, and the study's next run evaluates it.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median
from typing import Any

from fathom.common.files import write_atomic
from fathom.common.tables import markdown_table
from fathom.pipeline.config.history import shown
from fathom.pipeline.config.resume_rules import flat
from fathom.pipeline.config.run_config import RunConfig
from fathom.study.classes import CLASSES, DIVERGED, EVALUATING, INTERRUPTED, TRAINED, classify
from fathom.study.figures import divergence_map, early_steps, heatmap, loss_curves, source_curves, source_gap
from fathom.study.grid import (
    AXES,
    Cell,
    Grid,
    StudySpec,
    cell_config,
    cell_dir,
    cell_records,
    cells,
    combinations,
    evaluation_inputs,
    grid_cell,
    number_text,
    read_cell,
    read_sittings,
    training,
)

REPORT = "report.md"


def evaluation_due(spec: StudySpec, cell: Cell, result: dict[str, Any], baseline: float, cfg: RunConfig) -> str | None:
    """Why the evaluation in the cell's cell.json is not the one to report, None if it is: one that ended,
    made of the cell's latest checkpoint with the study's search settings, with a BLEU if the cell trained
    (the margins above, changed since, can turn a cell stalled when evaluated into a trained one)."""
    if "eval_seconds" not in result:
        return "evaluation interrupted"
    if "evaluated" not in result:
        return "evaluated by an older fathom, which did not record how"
    made, now = flat(result["evaluated"]), flat(evaluation_inputs(spec, cell))
    if key := next((key for key in now if made.get(key) != now[key]), None):
        return f"evaluated with {key}={shown(made, key)}, the study now gives {shown(now, key)}"
    if "bleu" not in result and classify(cell_records(cell_dir(spec, cell)), result, baseline, cfg)[0] == TRAINED:
        return "stalled when evaluated, so not decoded, but trained by today's margins"
    return None


def cell_summary(spec: StudySpec, cell: Cell, baseline: float) -> dict[str, Any] | None:
    """The cell's class and results; for a cell stopped before it finished, the last step it logged
    (the study's next run resumes it), and for one whose evaluation is due, why; None for a cell that
    has not started."""
    result = read_cell(spec, cell)
    records = cell_records(cell_dir(spec, cell))
    steps = [r["step"] for r in records if "loss" in r]
    if result is None:
        return {"cell": cell.name, "class": INTERRUPTED, "step": steps[-1]} if steps else None
    cfg = cell_config(spec, cell)
    if due := evaluation_due(spec, cell, result, baseline, cfg):
        result = training(result)  # no numbers of an evaluation that is not this study's
    label, why = classify(records, result, baseline, cfg)
    if due and label != DIVERGED:  # diverged is known from the training's own logs
        label, why = EVALUATING, f"training ended at step {max(steps, default=0)}; {due}; the next run evaluates it"
    tokens = [r["tokens"] for r in records if "tokens" in r]
    machines = dict.fromkeys(cpu_text(sitting) for sitting in read_sittings(spec, cell))
    result = {key: value for key, value in result.items() if key != "data"}  # every file's checksum: for checks
    return {"cell": cell.name, "class": label, "why": why, **result,
            "tokens_per_update": sum(tokens) / len(tokens) if tokens else None, "cpus": list(machines)}  # fmt: skip


def cpu_text(sitting: dict[str, Any]) -> str:
    flags = "avx512_bf16" if sitting["avx512_bf16"] else "no avx512_bf16"
    return f"{sitting['model']} ({flags}, {sitting['usable_cores']} cores)"


def entry(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return "not run"
    if summary["class"] == INTERRUPTED:
        return f"interrupted at step {summary['step']}"
    if summary["class"] == TRAINED:
        return f"trained: {summary['valid_nll']:.2f} / {summary['shuffled_nll']:.2f}, BLEU {summary['bleu']:.1f}"
    return f"{summary['class']}: {summary['why']}"


LABELS = {**{axis.key: axis.tag for axis in AXES}, "variants": ""}


def combination_text(combination: dict[str, Any]) -> str:
    return ", ".join(f"{LABELS[k]} {number_text(v)}" if LABELS[k] else str(v) for k, v in combination.items())


def grid_table(spec: StudySpec, grid: Grid, summaries: dict[Cell, dict[str, Any] | None]) -> str:
    """Schemes x depths for a grid of those alone; otherwise (scheme, depth) x the axes' combinations."""
    depths = sorted(grid.depths)
    if not grid.axes():
        rows = [[s, *(entry(summaries[grid_cell(spec, s, d, {})]) for d in depths)] for s in grid.schemes]
        return markdown_table(["scheme", *(f"{d}L-{d}L" for d in depths)], rows)
    columns = combinations(grid)
    one_depth = len(depths) == 1
    header = ["scheme" + (f" ({depths[0]}L-{depths[0]}L)" if one_depth else ""), *map(combination_text, columns)]
    rows = []
    for d in depths:
        for scheme in grid.schemes:
            label = scheme if one_depth else f"{scheme} {d}L-{d}L"
            rows.append([label, *(entry(summaries[grid_cell(spec, scheme, d, c)]) for c in columns)])
    return markdown_table(header, rows)


def tables(spec: StudySpec, summaries: dict[Cell, dict[str, Any] | None]) -> str:
    """The main grid, then each further grid under its title."""
    sections = [grid_table(spec, spec.main_grid(), summaries)]
    sections += [(f"### {g.title}\n\n" if g.title else "") + grid_table(spec, g, summaries) for g in spec.grids]
    return "\n\n".join(sections)


def cell_list(summaries: dict[Cell, dict[str, Any] | None]) -> str:
    """Every cell that ran: its class, losses, tokens per update, time and the CPUs it trained on."""
    rows = []
    for summary in summaries.values():
        if summary is None or summary["class"] == INTERRUPTED:
            continue
        losses = f"{summary['valid_nll']:.2f} / {summary['shuffled_nll']:.2f}" if "valid_nll" in summary else "-"
        tokens = summary["tokens_per_update"]
        rows.append([
            summary["cell"], summary["class"], losses, f"{summary['bleu']:.1f}" if "bleu" in summary else "-",
            f"{tokens:,.0f}" if tokens else "-", f"{(summary['seconds'] + summary.get('eval_seconds', 0)) / 60:.1f}",
            " + ".join(summary["cpus"]) or "not recorded",
        ])  # fmt: skip
    header = ["cell", "class", "valid / shuffled", "BLEU", "target tokens per update", "minutes", "CPU"]
    return markdown_table(header, rows)


def hours_by_class(summaries: dict[Cell, dict[str, Any] | None]) -> str:
    hours = dict.fromkeys(CLASSES, 0.0)
    for s in summaries.values():
        if s is not None and s["class"] in hours:
            hours[s["class"]] += (s["seconds"] + s.get("eval_seconds", 0)) / 3600
    return ", ".join(f"{label} {h:.2f} h" for label, h in hours.items())


def early_gradients(spec: StudySpec, summaries: dict[Cell, dict[str, Any] | None]) -> str:
    """Fig. 3's numbers at the main grid's deepest depth: the gradient norm (before clipping) of step 1,
    the largest of steps 1-10, and the medians of steps 11-50 and of the last third of the run."""
    depth = max(spec.depths)
    rows = []
    for scheme in spec.schemes:
        if (summaries[Cell(scheme, depth)] or {}).get("class", INTERRUPTED) == INTERRUPTED:
            continue
        norms = [r["grad_norm"] for r in cell_records(cell_dir(spec, Cell(scheme, depth))) if "grad_norm" in r]
        if len(norms) >= 50:
            numbers = [norms[0], max(norms[:10]), median(norms[10:50]), median(norms[-len(norms) // 3 :])]
            rows.append([scheme, *(f"{n:.3g}" for n in numbers)])
    header = [f"{depth}L-{depth}L", "step 1", "largest of steps 1-10", "median of steps 11-50", "median, last third"]
    return markdown_table(header, rows) if rows else ""


def write_report(spec: StudySpec, baseline: float) -> Path:
    """STUDY/report.md with its figures and STUDY/summary.json, from the cells' logs and the unigram
    `baseline` of the study's data; returns the report. Everything is drawn and written anew."""
    out = Path(spec.out)
    summaries = {cell: cell_summary(spec, cell, baseline) for cell in cells(spec)}
    divergence_map(spec, summaries, out / "divergence_map.png")
    loss_curves(spec, out / "valid_loss.png")
    early_steps(spec, out / "early_steps.png")
    figures = ["divergence_map.png", "valid_loss.png", "early_steps.png", *source_curves(spec, summaries, out)]
    for name, drawn in (
        ("grad_norm_heatmap.png", heatmap(spec, out / "grad_norm_heatmap.png")),
        ("source_gap.png", source_gap(spec, summaries, out / "source_gap.png")),
    ):
        if drawn:
            figures.append(name)
        else:  # an earlier report's (of another heatmap cell, say) would pass for this one's
            (out / name).unlink(missing_ok=True)
    finished = [s for s in summaries.values() if s and s["class"] in CLASSES]
    seconds = sum(s["seconds"] + s.get("eval_seconds", 0) for s in finished)
    lines = [
        f"# Depth study: {out.name}",
        "",
        f"Entries: class, then validation loss (unsmoothed nats per token, real / shuffled sources) and "
        f"validation BLEU for trained cells. "
        f"Unigram baseline {baseline:.2f}. Finished cells took {seconds / 3600:.2f} h (training and evaluation): "
        f"{hours_by_class(summaries)}.",
        "",
        tables(spec, summaries),
        "",
        *[f"![{name}]({name})" for name in figures],
        "",
        early_gradients(spec, summaries),
        "",
        "## Every cell",
        "",
        cell_list(summaries),
        "",
    ]
    write_atomic(out / REPORT, "\n".join(lines))
    write_atomic(out / "summary.json", json.dumps(finished, indent=2) + "\n")
    return out / REPORT
