"""The one-line error every user mistake ends in, and how a command-line entry point exits with it (a
command's other steps: docs/DESIGN.md, "A new command")."""

from __future__ import annotations

import difflib
import math
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


class ConfigError(ValueError):
    """A configuration mistake a user must fix; the message is one line naming key and fix."""


# How long a rank that is not the reporter waits before exiting on a config error. The launcher kills
# every rank as soon as one exits, so a quiet rank that exits first can kill the reporter before its
# line is out; waiting lets the reporter's exit end the job. If the wait runs out, the error was this
# rank's alone (a file only its node lacks) and it reports it itself.
REPORTER_GRACE_S = 20.0


@contextmanager
def exit_on_config_error(report: bool = True) -> Iterator[None]:
    """For command-line entry points: a ConfigError ends the process with its one line on stderr and
    exit status 2; a file that cannot be read or written (a full disk, permissions) with the system's
    line and exit status 1; a Ctrl-C with one line and 130, as a shell reports it (every command writes its
    outputs whole or not at all, so nothing half-written is left). With `report` false (every rank but the
    first) the process first waits REPORTER_GRACE_S for the first rank to report the same error and end
    the job."""
    try:
        yield
    except KeyboardInterrupt:
        print("fathom: stopped by SIGINT (Ctrl-C); nothing half-written is left", file=sys.stderr, flush=True)
        sys.exit(130)
    except ConfigError as err:
        _exit_with(str(err), 2, report)
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        _exit_with(f"{where}{err.strerror or err}", 1, report)


def _exit_with(message: str, status: int, report: bool) -> None:
    if not report:
        time.sleep(REPORTER_GRACE_S)
    print(f"fathom: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def unknown_key_error(key: str, known: Iterable[str]) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"
    return ConfigError(f"{key}: unknown key; {hint}")


def closest(key: str, known: set[str] | frozenset[str]) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def check_number(
    option: str,
    value: float | None,
    least: float,
    most: float | None = None,
    what: str = "",
    below: float | None = None,
) -> None:
    """A number out of [least, most] (or [least, below)) fails in one line naming `option`; None (an option
    left out) passes. `what` follows the bound: a unit (" piece") or what the edge means (" (0: the whole
    split)"). least=-inf asks only for a finite number."""
    if value is None:
        return
    # NaN passes every comparison as false and infinity every lower bound: a float must be finite first
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{option}: must be a finite number, got {value}")
    if value < least or (most is not None and value > most) or (below is not None and value >= below):
        if below is not None:
            bound = f"in [{least}, {below})"
        else:
            bound = f"at least {least}" if most is None else f"from {least} to {most}"
        raise ConfigError(f"{option}: must be {bound}{what}, got {value}")


def check_counts(counts: dict[str, int | None]) -> None:
    """check_number for options that count something, each at least 1 (by option)."""
    for option, value in counts.items():
        check_number(option, value, 1)


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated integers, e.g. 12,50,100 (a non-integer is argparse's error)."""
    return tuple(int(value) for value in text.split(","))
