"""matplotlib, an optional extra (pip install -e '.[plot]'), drawing to files only."""

from __future__ import annotations

from types import ModuleType

from fathom.common.errors import ConfigError


def matplotlib_module(what: str) -> ModuleType:
    """matplotlib itself, without pyplot: pyplot's first import on a machine builds a font cache by running
    fc-list, which finding out whether matplotlib is installed need not do. Without it, one line naming the
    install command; `what`: the command that draws, for that line."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ConfigError(f"{what} draws with matplotlib, which is not installed; pip install -e '.[plot]'") from None
    return matplotlib


def pyplot(what: str) -> ModuleType:
    """matplotlib.pyplot on the file-only backend (see matplotlib_module)."""
    matplotlib_module(what).use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt
