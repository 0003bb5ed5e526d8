"""What data preparation is asked to do (PrepareOptions, the command's flags as fields, with their
defaults) and the checks that refuse options out of range or in conflict, before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fathom.common.errors import ConfigError, check_number
from fathom.corpus import filters
from fathom.corpus.filters import FilterSettings

SPM_SAMPLE = 500_000  # sentences: SentencePiece needs about 2.8 KB a WMT-length sentence (1.4 GB here)
SPM_SEED = 1


@dataclass(frozen=True)
class PrepareOptions:
    """What to prepare, as the command's flags say it (--spm-model is spm_model, --dict dictionaries); the
    raw text of each split is PREFIX.SRC and PREFIX.TGT, plain or .gz."""

    src: str
    tgt: str
    train: str | Path  # prefix
    valid: str | Path  # prefix
    out: str | Path
    test: tuple[str | Path, ...] = ()  # prefixes of the splits test, test1, test2, ...
    vocab_size: int | None = None  # required unless spm_model or vocab_from gives the model
    separate_vocab: bool = False
    model_type: str = "unigram"
    spm_sample: int = SPM_SAMPLE
    spm_seed: int = SPM_SEED
    spm_model: tuple[str | Path, ...] = ()  # one (both sides) or two (source, target)
    dictionaries: tuple[str | Path, ...] = ()  # with spm_model: fairseq dictionaries instead of counted ones
    vocab_from: str | Path | None = None  # a prepared directory whose models and dictionaries to use
    filters: FilterSettings = field(default_factory=FilterSettings)
    workers: int | None = None  # processes that encode; None: one per CPU this process may use
    force: bool = False  # replace an existing output directory

    def check(self) -> None:
        """Fails in one ConfigError line, naming the flag, where an option is out of range or they clash."""
        if self.src == self.tgt:
            raise ConfigError(f"--src and --tgt are both '{self.src}'; the two sides need different suffixes")
        if self.vocab_size is None and not (self.spm_model or self.vocab_from):
            raise ConfigError("--vocab-size: required unless --spm-model or --vocab-from gives the model")
        check_number("--vocab-size", self.vocab_size, 8)
        for option in filters.options():
            check_number(option.flag, self.filters.value(option), option.least, what=option.what)
        check_number("--workers", self.workers, 1)
        check_number("--spm-sample", self.spm_sample, 1, what=" sentence")
        check_number("--spm-seed", self.spm_seed, 0)  # numpy's seeds are non-negative
        if self.vocab_from and (self.spm_model or self.separate_vocab):
            raise ConfigError(
                "--vocab-from gives the models and dictionaries; leave out --spm-model and --separate-vocab"
            )
        if len(self.spm_model) > 2:
            raise ConfigError(
                f"--spm-model: {len(self.spm_model)} files; give one (both sides) or two (source, target)"
            )
        if self.spm_model and self.separate_vocab and len(self.spm_model) != 2:
            raise ConfigError("--spm-model with --separate-vocab: give two models, the source's and the target's")
        if self.dictionaries and not self.spm_model:
            raise ConfigError("--dict: give the SentencePiece model its pieces come from with --spm-model")
        if len(self.dictionaries) > 2:
            raise ConfigError(f"--dict: {len(self.dictionaries)} files; give one (both sides) or two (source, target)")
