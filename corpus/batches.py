"""Feeding the pipeline engine: corpora, length-grouped token-budget batches, resumable micro-batch streams.

A corpus is anything with `__len__`, `pair(i) -> (src ids, tgt ids)` (without eos), `lengths()`,
`fingerprint()` and the two vocabulary sizes: the built-in synthetic task here, or a binarized real corpus
(corpus/dataset.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fathom.common.errors import ConfigError
from fathom.common.sections import bounds
from fathom.model.model_config import EOS, NUM_SPECIAL, PAD

MicroBatch = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


class ParallelCorpus(Protocol):
    src_vocab_size: int
    tgt_vocab_size: int

    def __len__(self) -> int: ...

    def pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def lengths(self) -> np.ndarray: ...

    def fingerprint(self) -> Any:
        """What identifies the pairs in their order, comparable across processes and versions: equal
        fingerprints, equal pairs."""
        ...


def check_budget(lengths: np.ndarray, size: BatchSize) -> None:
    """Every pair fits a micro-batch's token budget."""
    if size.max_tokens is not None and lengths.max() > size.max_tokens:
        raise ConfigError(
            f"data.max_tokens: {size.max_tokens} is below the longest training pair ({lengths.max()} "
            "tokens); raise it, or prepare the data with a smaller --max-len"
        )


@dataclass
class SyntheticConfig:
    words: int = field(default=16, metadata=bounds(1))
    sentences: int = field(default=20000, metadata=bounds(1))
    valid_sentences: int = field(default=500, metadata=bounds(0))
    min_len: int = field(default=3, metadata=bounds(1))
    max_len: int = field(default=6, metadata=bounds(1))
    seed: int = field(default=1, metadata=bounds(0))

    def __post_init__(self) -> None:
        if self.max_len < self.min_len:
            raise ConfigError(f"data.synthetic.max_len: {self.max_len} is below data.synthetic.min_len {self.min_len}")


class SyntheticTranslation:
    """A made-up language pair: the target is the source reversed, each word mapped by a fixed cipher.

    Solving it needs both reordering (attention across the sentence) and a lexicon, like
    translation, yet it is generated in milliseconds and needs no files. The valid split holds
    further sentences of the same language pair.
    """

    def __init__(self, cfg: SyntheticConfig, split: str = "train"):
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.cipher = torch.randperm(cfg.words, generator=gen) + NUM_SPECIAL
        self.src_vocab_size = self.tgt_vocab_size = NUM_SPECIAL + cfg.words
        total = cfg.sentences + cfg.valid_sentences
        lengths = torch.randint(cfg.min_len, cfg.max_len + 1, (total,), generator=gen)
        sources = [torch.randint(0, cfg.words, (int(n),), generator=gen) for n in lengths]
        self.sources = sources[: cfg.sentences] if split == "train" else sources[cfg.sentences :]

    def __len__(self) -> int:
        return len(self.sources)

    def pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        words = self.sources[index]
        return words + NUM_SPECIAL, self.cipher[words.flip(0)]

    def lengths(self) -> np.ndarray:
        return np.array([len(s) + 1 for s in self.sources])

    def fingerprint(self) -> dict[str, Any]:
        # every setting: the valid split's size moves the generator before the training sentences are drawn
        return {"synthetic": asdict(self.cfg)}


def _pad(rows: list[torch.Tensor], multiple: int = 1) -> torch.Tensor:
    """One right-padded batch, as long as its longest row rounded up to a multiple of `multiple`."""
    batch = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)
    return torch.nn.functional.pad(batch, (0, -batch.size(1) % multiple), value=PAD)


def with_eos(sentences: list[torch.Tensor], multiple: int = 1) -> torch.Tensor:
    """Sentences of token ids (without eos) as one right-padded batch, each ending in eos."""
    eos = torch.tensor([EOS])
    return _pad([torch.cat([s, eos]) for s in sentences], multiple)


def length_batches(sources: list[torch.Tensor], indices: Iterable[int], size: int) -> list[list[int]]:
    """The given indices of `sources`, grouped `size` at a time by source length (ties in given order):
    decoding batches with little padding."""
    ordered = sorted(indices, key=lambda i: len(sources[i]))
    return [ordered[start : start + size] for start in range(0, len(ordered), size)]


# What decides fairseq-generate's batches besides --batch-size: its defaults --seed 1 and
# --required-batch-size-multiple 8.
FAIRSEQ_SEED = 1
FAIRSEQ_BATCH_MULTIPLE = 8


def fairseq_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, size: int, shuffled: bool) -> list[list[int]]:
    """The batches, lists of pair indices, that fairseq-generate 0.12.2 decodes a split in with --batch-size
    `size` (no --max-tokens): LanguagePairDataset.ordered_indices sorts the pairs by source length, ties by
    target length, then by their place in a permutation drawn with the seed (`shuffled`: the translation
    task shuffles every split not named test) or by index; batch_by_size cuts that order into runs of
    `size` pairs, or of the multiple of 8 below it, and the rest into a multiple of 8 and what remains.
    The output limit (a x the batch's longest source + b) depends on the batch, so only these batches give
    fairseq's hypotheses wherever a hypothesis reaches it."""
    count, multiple = len(src_lengths), FAIRSEQ_BATCH_MULTIPLE
    order = np.random.RandomState(FAIRSEQ_SEED).permutation(count) if shuffled else np.arange(count)
    order = order[np.argsort(tgt_lengths[order], kind="stable")]
    order = order[np.argsort(src_lengths[order], kind="stable")]
    step = size if size < multiple else size - size % multiple
    rest = count % step
    sizes = [step] * (count // step) + [part for part in (rest - rest % multiple, rest % multiple) if part]
    return [batch.tolist() for batch in np.split(order, np.cumsum(sizes)[:-1])]


def collate(pairs: list[tuple[torch.Tensor, torch.Tensor]], pad_to_multiple: int = 1) -> MicroBatch:
    """fairseq's layout: source and target end in eos; the decoder input is eos + target[:-1]. Each side
    is padded to a multiple of `pad_to_multiple` tokens (data.pad_to_multiple)."""
    eos = torch.tensor([EOS])
    src = with_eos([s for s, _ in pairs], pad_to_multiple)
    target = with_eos([t for _, t in pairs], pad_to_multiple)
    prev_output_tokens = _pad([torch.cat([eos, t]) for _, t in pairs], pad_to_multiple)
    return (src, prev_output_tokens), target


@dataclass(frozen=True)
class BatchSize:
    """A micro-batch holds at most `sentences` pairs and, if set, at most `max_tokens` padded tokens
    (longest pair x number of pairs, counting the longer side with eos)."""

    sentences: int | None = None
    max_tokens: int | None = None
    # Each side of a micro-batch padded to a multiple of this many tokens: fewer shapes (CUDA graphs).
    pad_to_multiple: int = 1

    def pack(self, order: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Consecutive runs of `order`, each as long as the budget allows (greedy, in order). Found a window
        at a time with numpy: a Python loop over every pair takes seconds at WMT's millions."""
        if self.max_tokens is None:
            step = self.sentences or max(len(order), 1)
            return [order[start : start + step] for start in range(0, len(order), step)]
        batches, start, window = [], 0, 64
        ordered = lengths[order]
        while start < len(order):
            longest = np.maximum.accumulate(ordered[start : start + window])
            size = np.arange(1, len(longest) + 1)
            full = longest * size > self.max_tokens
            if self.sentences is not None:
                full |= size > self.sentences
            full[0] = False  # a pair alone always makes a batch (check_budget refuses what cannot fit)
            if not full.any() and start + window < len(order):
                window *= 2  # the batch may go on past the window
                continue
            stop = start + (int(full.argmax()) if full.any() else len(longest))
            batches.append(order[start:stop])
            start = stop
        return batches


def epoch_batches(lengths: np.ndarray, size: BatchSize, seed: int, epoch: int) -> list[np.ndarray]:
    """fairseq's recipe: shuffle, group by length (token budgets only), pack, shuffle the batches."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    if size.max_tokens is not None:
        order = order[np.argsort(lengths[order], kind="stable")]
    batches = size.pack(order, lengths)
    return [batches[i] for i in rng.permutation(len(batches))]


def eval_batches(corpus: ParallelCorpus, size: BatchSize) -> list[MicroBatch]:
    """Every pair once, grouped by length, in a fixed order."""
    lengths = corpus.lengths()
    order = np.argsort(lengths, kind="stable")
    return [collate([corpus.pair(int(i)) for i in batch], size.pad_to_multiple) for batch in size.pack(order, lengths)]


def epoch_length(lengths: np.ndarray, size: BatchSize, seed: int) -> int:
    """Micro-batches in an epoch. The same in every epoch: each packs the same sequence of lengths (sorted,
    under a token budget) or the same number of pairs."""
    return len(epoch_batches(lengths, size, seed, 0))


@dataclass(frozen=True)
class DataPosition:
    """Which micro-batch of the run's fixed order each replica reads in each step of a launch. Before
    step `step`, `consumed` micro-batches had been read, by every launch before this one whatever its
    shape; each step then reads `accumulation` micro-batches on each of `replicas` replicas, replica r
    the r-th of every `replicas`."""

    consumed: int = 0
    step: int = 0
    accumulation: int = 1
    replicas: int = 1

    def at(self, step: int) -> int:
        """Micro-batches read before `step`: the index of the first one `step` reads."""
        return self.consumed + (step - self.step) * self.accumulation * self.replicas

    def step_ending(self, micro_batches: int) -> int:
        """The step that reads the run's `micro_batches`-th micro-batch (the last step before it, if read)."""
        per_step = self.accumulation * self.replicas
        return self.step + max(0, -(-(micro_batches - self.consumed) // per_step))

    def micro_batch(self, step: int, k: int, replica: int) -> int:
        """The index, in the run's fixed order, of the k-th micro-batch `replica` reads in `step`."""
        return self.at(step) + k * self.replicas + replica


class MicroBatches:
    """Micro-batches in a fixed order determined by (seed, epoch): the n-th micro-batch of a run is always
    the same, so a resumed run continues with the first one it had not read (`start`), mid-epoch included,
    whatever its accumulation or replica count (DataPosition)."""

    def __init__(
        self,
        corpus: ParallelCorpus,
        size: BatchSize,
        seed: int,
        start: int = 0,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
    ):
        self.corpus, self.size, self.seed = corpus, size, seed
        self.lengths = corpus.lengths()
        check_budget(self.lengths, size)
        self.world = data_parallel_size
        self.next = start + data_parallel_rank
        self.epoch, self.epoch_start = 0, 0
        self.plan = epoch_batches(self.lengths, size, seed, 0)
        self.per_epoch = len(self.plan)  # every epoch's (epoch_length)
        self.target_tokens = 0  # real (non-pad) target tokens handed out so far, for throughput

    def _indices(self, global_index: int) -> np.ndarray:
        while global_index >= self.epoch_start + len(self.plan):
            self.epoch_start += len(self.plan)
            self.epoch += 1
            self.plan = epoch_batches(self.lengths, self.size, self.seed, self.epoch)
        return self.plan[global_index - self.epoch_start]

    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        batch = collate([self.corpus.pair(int(i)) for i in self._indices(self.next)], self.size.pad_to_multiple)
        self.next += self.world
        self.target_tokens += int(batch[1].ne(PAD).sum())
        return batch
