"""Parallel data for the pipeline engine: the built-in synthetic task and resumable micro-batches.

A corpus is anything with `__len__`, `pair(i) -> (src ids, tgt ids)` (without eos) and the
two vocabulary sizes, so a binarized real corpus plugs in beside the synthetic one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from model.config import EOS, NUM_SPECIAL, PAD

MicroBatch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


class ParallelCorpus(Protocol):
    src_vocab_size: int
    tgt_vocab_size: int

    def __len__(self) -> int: ...

    def pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class SyntheticConfig:
    words: int = 16
    sentences: int = 20000
    min_len: int = 3
    max_len: int = 6
    seed: int = 1


class SyntheticTranslation:
    """A made-up language pair: the target is the source reversed, each word mapped by a fixed cipher.

    Solving it needs both reordering (attention across the sentence) and a lexicon, like
    translation, yet it is generated in milliseconds and needs no files.
    """

    def __init__(self, cfg: SyntheticConfig):
        gen = torch.Generator().manual_seed(cfg.seed)
        self.cipher = torch.randperm(cfg.words, generator=gen) + NUM_SPECIAL
        self.src_vocab_size = self.tgt_vocab_size = NUM_SPECIAL + cfg.words
        lengths = torch.randint(cfg.min_len, cfg.max_len + 1, (cfg.sentences,), generator=gen)
        self.sources = [torch.randint(0, cfg.words, (int(n),), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.sources)

    def pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        words = self.sources[index]
        return words + NUM_SPECIAL, self.cipher[words.flip(0)]


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)


def collate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> MicroBatch:
    """fairseq's layout: source and target end in eos; the decoder input is eos + target[:-1]."""
    eos = torch.tensor([EOS])
    src = _pad([torch.cat([s, eos]) for s, _ in pairs])
    target = _pad([torch.cat([t, eos]) for _, t in pairs])
    prev_output_tokens = _pad([torch.cat([eos, t]) for _, t in pairs])
    return (src, prev_output_tokens), target


class MicroBatches:
    """Micro-batches in a fixed order determined by (seed, epoch): step s always sees the same data.

    Global micro-batch g = (step * accumulation + k) * data_parallel_size + data_parallel_rank,
    so a resumed run continues exactly where the interrupted one stopped.
    """

    def __init__(
        self,
        corpus: ParallelCorpus,
        batch_size: int,
        seed: int,
        start_step: int = 0,
        accumulation: int = 1,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
    ):
        if len(corpus) < batch_size:
            raise ValueError(f"the corpus has {len(corpus)} pairs, fewer than one micro-batch of {batch_size}")
        self.corpus, self.batch_size, self.seed = corpus, batch_size, seed
        self.batches_per_epoch = len(corpus) // batch_size
        self.rank, self.world = data_parallel_rank, data_parallel_size
        self.next = start_step * accumulation * data_parallel_size + data_parallel_rank
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)
        self.target_tokens = 0  # real (non-pad) target tokens handed out so far, for throughput

    def _indices(self, global_index: int) -> list[int]:
        epoch, position = divmod(global_index, self.batches_per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.corpus), generator=gen)
        return self._order[position * self.batch_size : (position + 1) * self.batch_size].tolist()

    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        batch = collate([self.corpus.pair(i) for i in self._indices(self.next)])
        self.next += self.world
        self.target_tokens += int(batch[1].ne(PAD).sum())
        return batch
