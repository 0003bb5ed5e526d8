"""What pipeline.activation_checkpoint_interval "auto" chose at launch: the run's config holds it beside
the interval it gave the engine, and the memory report records it against what each stage measured."""

from __future__ import annotations

from dataclasses import dataclass

from fathom.common.sizes import size_text


@dataclass(frozen=True)
class CheckpointChoice:
    """What pipeline.activation_checkpoint_interval "auto" chose before launch (pipeline/parts/
    auto_checkpointing.py), and the estimate it chose by."""

    interval: int
    estimated_peaks: tuple[int, ...]  # bytes per stage at `interval` (pipeline/parts/stage_memory.py)
    memory: int  # bytes: train.memory_budget, else the GPU's memory
    reserve: float  # the share of `memory` kept free of the estimate
    source: str  # where `memory` came from, for the launch's line
    caveat: str = ""  # what the estimate leaves out on this machine, for the launch's line

    @property
    def usable(self) -> int:
        """What every stage's estimated peak fits in."""
        return int(self.memory * (1 - self.reserve))

    def line(self) -> str:
        """The launch's line: the choice, the largest stage's estimate, and what it had to fit."""
        chosen = f"every {self.interval} layers" if self.interval > 1 else "every layer" if self.interval else "none"
        peak = max(self.estimated_peaks)
        stage = self.estimated_peaks.index(peak)
        return (
            f'activation checkpointing "auto": {chosen}; estimated peak {size_text(peak)} (stage {stage}) of the '
            f"{size_text(self.usable)} usable ({self.source} {size_text(self.memory)} less a {self.reserve:.0%} "
            f"reserve){self.caveat}"
        )
