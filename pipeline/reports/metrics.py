"""The JSON-lines logs a run appends to (metrics.jsonl, grad_norms.jsonl): one record a line, the last
of which a crash may have cut short."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fathom.common.files import write_atomic
from fathom.common.jsonl import read_jsonl, write_record


def monitor_events(record: dict[str, Any]) -> list[tuple[str, float, int]]:
    """A metrics.jsonl record as DeepSpeed monitor events, `fathom/KEY` at the record's global step: every
    number in it (a flag such as `skipped` as 1), none of its words."""
    numbers = {key: float(value) for key, value in record.items() if isinstance(value, int | float) and key != "step"}
    return [(f"fathom/{key}", value, record["step"]) for key, value in numbers.items()]


class MetricsLog:
    """<save_dir>/metrics.jsonl, one JSON line per global step, written by global rank 0 only; with a
    DeepSpeed monitor (tensorboard, csv_monitor, wandb, comet), each record's figures go there too."""

    def __init__(self, path: Path, enabled: bool, resume_step: int, monitor: Any = None):
        self.path, self.enabled = path, enabled
        self.monitor = monitor if monitor is not None and monitor.enabled else None
        if enabled and path.exists():
            # Steps after the checkpoint we resume from will be trained again: drop their old lines.
            kept = [record for record in read_jsonl(path) if record.get("step", 0) <= resume_step]
            write_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            write_record(self.path, record)
            if self.monitor is not None:
                self.monitor.write_events(monitor_events(record))
