"""The pairs preparation drops, each filter declared once in FILTERS.

A filter owns its command-line option, the meta.json key counting the pairs it dropped, and the words
the closing summary and the "no pairs left" error use for them. corpus/binarize.py applies the list to
every chunk; corpus/prepare.py builds its options, meta.json's "filters" record and counts, the summary
and the error from it, and corpus/prepare_options.py the options' checks. A new filter is a new entry
here, its option's field in FilterSettings, and its test.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Setting = int | float | None  # an option's value; None: the filter is off


@dataclass(frozen=True)
class FilterSettings:
    """The filters' options, each named as its flag's argparse dest; None turns that filter off."""

    max_len: int | None = 256
    max_ratio: float | None = None

    def value(self, option: Option) -> Setting:
        return getattr(self, option.dest)

    def record(self) -> dict[str, Setting]:
        """As meta.json's "filters" records them."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Option:
    """A filter's command-line option, checked with common.errors.check_number; its default is its
    FilterSettings field's."""

    flag: str
    type: type
    help: str
    least: float
    what: str  # check_number's unit or meaning of the bound

    @property
    def dest(self) -> str:
        """argparse's attribute, FilterSettings' field, and the option's key in meta.json's "filters"."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def default(self) -> Setting:
        return FilterSettings().value(self)


@dataclass(frozen=True)
class Pairs:
    """A chunk's pairs as the filters see them."""

    texts: tuple[list[str], list[str]]
    lengths: np.ndarray  # (2, pairs): pieces per side


@dataclass(frozen=True)
class Filter:
    """One rule that drops pairs, with everything that names it."""

    counter: str  # meta.json's count of the pairs it dropped, per split
    label: str  # the summary's and the error's words for them: "12 over --max-len"
    drops: Callable[[Pairs, Setting], np.ndarray]  # which pairs it drops, given its option's value
    option: Option | None = None  # None: always on
    held_out: bool = False  # drops valid and test pairs too, not only training pairs
    kept: str | None = None  # meta.json's count of the held-out pairs it would drop, which are kept
    loosen: str = "raise"  # what to do to the option when it leaves no training pair


def empty(src: str, tgt: str) -> bool:
    """A side with no text: such a pair is dropped from every split and from SentencePiece's sample."""
    return not (src.strip() and tgt.strip())


def any_side_empty(pairs: Pairs, _: Setting) -> np.ndarray:
    return np.fromiter(itertools.starmap(empty, zip(*pairs.texts, strict=True)), bool, count=pairs.lengths.shape[1])


def too_long(pairs: Pairs, max_len: Setting) -> np.ndarray:
    return (pairs.lengths > max_len).any(axis=0)


def unbalanced(pairs: Pairs, max_ratio: Setting) -> np.ndarray:
    return pairs.lengths.max(axis=0) > max_ratio * pairs.lengths.min(axis=0)


# In the order they apply: a pair is counted by the first that drops it.
FILTERS = [
    Filter(counter="dropped_empty", label="empty", drops=any_side_empty, held_out=True),
    Filter(
        counter="dropped_too_long",
        label="over --max-len",
        drops=too_long,
        option=Option("--max-len", int, help="drop training pairs longer (in pieces)", least=1, what=" piece"),
        kept="kept_too_long",
    ),
    Filter(
        counter="dropped_ratio",
        label="over --max-ratio",
        drops=unbalanced,
        option=Option(
            "--max-ratio",
            float,
            help="drop training pairs whose longer side is over R x the other",
            least=1,
            what=" (sides of equal length)",
        ),
    ),
]


def options() -> list[Option]:
    return [f.option for f in FILTERS if f.option is not None]


def active(settings: FilterSettings) -> list[tuple[Filter, Setting]]:
    """The filters that are on, each with its option's value (None for one without an option)."""
    on = [(f, None if f.option is None else settings.value(f.option)) for f in FILTERS]
    return [(f, value) for f, value in on if f.option is None or value is not None]


def counters() -> list[str]:
    """meta.json's counts of a split, in its order."""
    return [*(f.counter for f in FILTERS), *(f.kept for f in FILTERS if f.kept)]


def apply(pairs: Pairs, settings: FilterSettings, train: bool) -> tuple[np.ndarray, dict[str, int]]:
    """Which pairs are kept, and the counts: the pairs each filter dropped, and, in a held-out split,
    the kept pairs that a training-only filter with a `kept` count would have dropped."""
    keep = np.ones(pairs.lengths.shape[1], dtype=bool)
    counts = dict.fromkeys(counters(), 0)
    on = active(settings)
    for f, value in on:
        if train or f.held_out:
            dropped = f.drops(pairs, value) & keep
            counts[f.counter] = int(dropped.sum())
            keep &= ~dropped
    for f, value in on:
        if not (train or f.held_out) and f.kept:
            counts[f.kept] = int((f.drops(pairs, value) & keep).sum())
    return keep, counts
