"""The JSON-lines logs a run appends to (metrics.jsonl, grad_norms.jsonl): one record a line, the last
of which a crash may have cut short."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fathom.common.files import write_atomic
from fathom.common.jsonl import read_jsonl, write_record


class MetricsLog:
    """<save_dir>/metrics.jsonl, one JSON line per global step, written by global rank 0 only."""

    def __init__(self, path: Path, enabled: bool, resume_step: int):
        self.path, self.enabled = path, enabled
        if enabled and path.exists():
            # Steps after the checkpoint we resume from will be trained again: drop their old lines.
            kept = [record for record in read_jsonl(path) if record.get("step", 0) <= resume_step]
            write_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            write_record(self.path, record)
