"""What every fathom command's command line shares: its help text from the module's docstring, and
`--version`."""

import argparse
from importlib.metadata import PackageNotFoundError, version


def versions() -> str:
    """fathom's and DeepSpeed's versions, read from the installed distributions (DeepSpeed is not
    imported: commands that only translate never load it)."""
    try:
        deepspeed = version("deepspeed")
    except PackageNotFoundError:
        deepspeed = "not installed"
    return f"fathom {version('fathom')}, DeepSpeed {deepspeed}"


def command_parser(description: str | None) -> argparse.ArgumentParser:
    """An ArgumentParser whose help keeps the docstring's line breaks, with `--version`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=versions())
    return parser
