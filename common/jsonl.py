"""The JSON-lines logs a run appends to (metrics.jsonl, grad_norms.jsonl, ...): one record a line, the
last of which a crash may have cut short."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fathom.common.errors import ConfigError


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A log's records. A torn last line (a crash while writing it) is left out with one warning line;
    damage anywhere else is an error, since records would be silently missing."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    if lines[-1] == "":  # the newline that ends the last record
        lines.pop()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number == len(lines):
            print(f"fathom: warning: {path}: line {number} is cut short (a crash while writing it?); left out",
                  file=sys.stderr)  # fmt: skip
        else:
            raise ConfigError(f"{path}: line {number} is not a JSON record; the log is damaged: remove that line")
    return records


def write_record(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
