"""How much a trained model uses its source, measured on the validation split: its loss with the real
sources, with each target given another sentence's source, and the loss of the best model that reads
no source at all (the target unigram distribution). The depth study tells a model that translates
from one that only learned the target language with them (study/report.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fathom.common.run_layout import committed_tags, tag_step
from fathom.corpus.batches import collate
from fathom.corpus.dataset import BinarizedCorpus
from fathom.model.loss import token_losses
from fathom.model.model_config import EOS
from fathom.model.trained import load_reference

Pair = tuple[torch.Tensor, torch.Tensor]  # (source, target) token ids


def unigram_nll(data: Path) -> float:
    """Validation loss (nats per target token, eos included) of the best model that ignores the source
    and the context: the training set's target unigram distribution, add-one smoothed."""
    train, valid = BinarizedCorpus(data, "train"), BinarizedCorpus(data, "valid")
    counts = np.ones(train.tgt_vocab_size)
    for i in range(len(train)):
        np.add.at(counts, train.targets[i], 1)
    counts[EOS] += len(train)  # one eos per sentence
    logp = np.log(counts / counts.sum())
    total = sum(-logp[valid.targets[i]].sum() - logp[EOS] for i in range(len(valid)))
    tokens = sum(len(valid.targets[i]) + 1 for i in range(len(valid)))
    return float(total / tokens)


def with_shuffled_sources(corpus: BinarizedCorpus) -> tuple[list[Pair], list[Pair]]:
    """The split's pairs, and the same targets each given the source of its neighbour in length order
    (similar lengths, another sentence)."""
    pairs = [corpus.pair(i) for i in range(len(corpus))]
    order = np.argsort(corpus.lengths(), kind="stable")
    sources = {int(order[k]): pairs[int(order[(k + 1) % len(order)])][0] for k in range(len(order))}
    return pairs, [(sources[i], target) for i, (_, target) in enumerate(pairs)]


@torch.no_grad()
def valid_nlls(save_dir: Path, data: Path) -> tuple[float, float]:
    """Unsmoothed validation loss of the run's latest checkpoint with real and with shuffled sources:
    how much the model uses the source."""
    model = load_reference(save_dir)
    pairs, shuffled = with_shuffled_sources(BinarizedCorpus(data, "valid"))
    return nll(model, pairs), nll(model, shuffled)


@torch.no_grad()
def source_curve(save_dir: Path, data: Path) -> list[dict[str, float]]:
    """Validation loss with real and with shuffled sources at each step the run committed a checkpoint
    of, in step order: when a model starts to use its source."""
    pairs, shuffled = with_shuffled_sources(BinarizedCorpus(data, "valid"))
    points: dict[int, dict[str, float]] = {}
    for tag in committed_tags(save_dir):
        if (step := tag_step(tag)) not in points:  # a step's best_ and plain checkpoints hold the same weights
            model = load_reference(save_dir, tag)
            points[step] = {"step": step, "valid_nll": nll(model, pairs), "shuffled_nll": nll(model, shuffled)}
    return list(points.values())


@torch.no_grad()
def nll(model: torch.nn.Module, pairs: list[Pair]) -> float:
    """Nats per target token (eos included) over `pairs`, in batches of similar lengths."""
    total, tokens = 0.0, 0
    order = np.argsort([max(len(s), len(t)) for s, t in pairs], kind="stable")
    for start in range(0, len(order), 64):
        (src, prev), target = collate([pairs[int(i)] for i in order[start : start + 64]])
        logits = model(src, prev)
        token_nlls = token_losses(logits, target, smoothing=0.0)[1]
        total += token_nlls.sum()
        tokens += token_nlls.numel()
    return total.item() / tokens
