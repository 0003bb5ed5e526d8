"""Output directories that appear complete or not at all."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from model.config import ConfigError


def check_out(out: Path, force: bool) -> None:
    """Fails on an existing, non-empty output directory unless --force."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"{out}: already exists; choose a new --out or pass --force to replace it")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh directory beside `out`, renamed to `out` (replacing it) only when the block completes:
    an error never leaves a half-written `out`, and the staging directory is always removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
