"""A depth study's cell classes, from the cell's own logs and its evaluation (study/report.py reports them).

A cell is
- `diverged`: stopped by a non-finite loss or gradient (train.on_nonfinite=stop), or its training loss
  after warmup rose above where it started;
- `stalled`: it ended with weights but did not learn the task: its validation loss is not clearly below
  the target unigram baseline, or it ignores the source (validation loss with shuffled sources within a
  small margin of the real one);
- `trained` otherwise.
"""

from __future__ import annotations

import math
from typing import Any

from fathom.pipeline.config.run_config import RunConfig
from fathom.study.grid import warmup_steps

DIVERGED, STALLED, TRAINED = "diverged", "stalled", "trained"
INTERRUPTED = "interrupted"  # not a class: a cell whose training has not ended
EVALUATING = "evaluating"  # not a class: a cell whose training ended, without the evaluation to report
CLASSES = (TRAINED, STALLED, DIVERGED)
# Nats per target token. Below the unigram baseline by less than this is not learning the task; a
# source-ignoring decoder is a language model, whose loss barely moves when the sources are shuffled.
BASELINE_MARGIN = 0.5
SOURCE_MARGIN = 0.1


def classify(records: list[dict[str, Any]], result: dict[str, Any], baseline: float, cfg: RunConfig) -> tuple[str, str]:
    """(class, why) of a cell from its metrics.jsonl records and its cell.json."""
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    if result["exit"] != 0:
        step = losses[-1][0] + 1 if losses else 1
        return DIVERGED, f"non-finite at step {step}"
    if bad := [step for step, loss in losses if not math.isfinite(loss)]:
        return DIVERGED, f"non-finite loss at step {bad[0]}"
    start = sum(loss for _, loss in losses[:10]) / max(1, len(losses[:10]))
    after = [loss for step, loss in losses if step > warmup_steps(cfg)]
    tail = after[-max(1, len(after) // 10) :]
    if tail and sum(tail) / len(tail) > start:
        return DIVERGED, f"training loss {sum(tail) / len(tail):.2f} ended above its start {start:.2f}"
    if "valid_nll" not in result:
        return STALLED, "no checkpoint to evaluate"
    nll, shuffled = result["valid_nll"], result["shuffled_nll"]
    if nll > baseline - BASELINE_MARGIN:
        return STALLED, f"validation loss {nll:.2f} vs unigram {baseline:.2f}"
    if shuffled - nll < SOURCE_MARGIN:
        return STALLED, f"ignores the source: {nll:.2f} vs {shuffled:.2f} shuffled"
    return TRAINED, f"validation loss {nll:.2f} ({shuffled:.2f} shuffled)"
