"""Where the repository is: tools and tests find its configs and scripts from here."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
