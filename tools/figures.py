"""matplotlib, an optional extra (pip install -e '.[plot]'), drawing to files only."""

from __future__ import annotations

from types import ModuleType

from common.errors import ConfigError


def pyplot(what: str) -> ModuleType:
    """matplotlib.pyplot on the file-only backend; without matplotlib, one line naming the install
    command. `what`: the command that draws, for that line."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ConfigError(f"{what} draws with matplotlib, which is not installed; pip install -e '.[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt
