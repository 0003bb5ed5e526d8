"""Batched beam search with fairseq's scoring, decoding incrementally on the model's device.

Every sentence of the batch and every beam advance together as tensors: the only Python loop is
over output positions, and each step runs the decoder on the newest position only, attending over
cached keys and values (model/cache.py). Hypotheses are finalized like fairseq's SequenceGenerator:
an eos among a sentence's top `beam` candidates ends a hypothesis scored sum(log p) / length **
lenpen (length counting the eos), a sentence is done after `beam` finalized hypotheses, the best one
wins, and a done sentence leaves the batch, so it costs no more compute.

The search talks to the model through a `StepDecoder`: `ModelDecoder` here runs the single-process
Transformer; pipeline/decode.py runs the same search through the stages of a pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from fathom.common.sections import bounds
from fathom.model.cache import DecoderCache, sentences_of
from fathom.model.model_config import EOS, PAD
from fathom.model.transformer import Transformer

# (scores, beam, token) of each sentence's 2 x beam best continuations, best first, (sentences, 2 x beam) each.
Candidates = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Choose = Callable[[torch.Tensor], Candidates]


@dataclass
class SearchConfig:
    """How every decoder of fathom searches (generate.py, translate.py, train.valid_bleu, the depth study's
    BLEU): one set of settings with one set of defaults, checked in one place. Each field is also a
    command-line flag of the decoding commands (translation/decoding_flags.py's add_search_args: --max-len-a
    for max_len_a, typed by the default, with the field's metadata "help") and a train.valid_bleu key. Each
    field's bounds are in its metadata, checked wherever the settings are read (common.sections)."""

    beam: int = field(default=4, metadata=bounds(1))
    lenpen: float = field(
        default=1.0, metadata={"help": "fairseq's length penalty (scores / len**lenpen)"} | bounds(-math.inf)
    )
    # Output length limit a x source length + b (fairseq's --eval-bleu-args example): an undertrained
    # model that never ends a sentence stops there instead of at the model's max_positions.
    max_len_a: float = field(default=1.2, metadata={"help": "output length limit: a x source length + b"} | bounds(0))
    max_len_b: int = field(default=10, metadata=bounds(1))
    batch_size: int = field(default=64, metadata={"help": "sentences per batch"} | bounds(1))


@dataclass
class Hypothesis:
    tokens: list[int]  # without the final eos
    score: float  # sum of log-probabilities (eos included) / length ** lenpen


class StepDecoder(Protocol):
    """One decoding step of some model over rows = sentences x beams."""

    def step(self, tokens: torch.Tensor, choose: Choose) -> Candidates:
        """Feeds each row's newest token (rows, 1); returns choose(next-token log-probabilities (rows, vocab))."""
        ...

    def reorder(self, rows: torch.Tensor, shrink: bool) -> None:
        """Row i continues from row rows[i]; `shrink`: rows of whole sentences were dropped."""
        ...


def max_length(src_tokens: torch.Tensor, max_positions: int, cfg: SearchConfig) -> int:
    """fairseq's output length limit for a batch: a * longest source + b, within the model's positions."""
    src_len = int(src_tokens.ne(PAD).sum(1).max())
    return min(int(cfg.max_len_a * src_len + cfg.max_len_b), max_positions - 1)


def chooser(scores: torch.Tensor, step: int, max_len: int, min_len: int) -> Choose:
    """The candidate rule for one step: each beam's score plus the next token's log-probability, pad never,
    eos not before min_len (fairseq's default forbids the empty translation) and only eos at max_len."""

    def choose(lprobs: torch.Tensor) -> Candidates:
        lprobs = lprobs.float()
        lprobs[:, PAD] = float("-inf")
        if step < min_len:
            lprobs[:, EOS] = float("-inf")
        if step == max_len:
            eos_column = lprobs[:, EOS].clone()
            lprobs.fill_(float("-inf"))
            lprobs[:, EOS] = eos_column
        sentences, k = scores.shape
        vocab = lprobs.size(-1)
        top_scores, top = (scores.view(-1, 1) + lprobs).view(sentences, k * vocab).topk(2 * k, dim=1)
        return top_scores, top // vocab, top % vocab

    return choose


@torch.no_grad()
def search(
    decoder: StepDecoder, src_tokens: torch.Tensor, max_positions: int, cfg: SearchConfig, min_len: int = 1
) -> list[Hypothesis]:
    """Best hypothesis per sentence of src_tokens, which the decoder was started on (rows sentence-major,
    cfg.beam rows a sentence), on their device; max_positions is the model's."""
    batch, k, lenpen, device = src_tokens.size(0), cfg.beam, cfg.lenpen, src_tokens.device
    max_len = max_length(src_tokens, max_positions, cfg)
    tokens = torch.full((batch * k, 1), EOS, dtype=torch.long, device=device)
    scores = torch.zeros(batch, k, device=device)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    finished = torch.full((batch, k, max_len + 1), PAD, dtype=torch.long, device=device)
    finished_scores = torch.full((batch, k), float("-inf"), device=device)
    num_finished = torch.zeros(batch, dtype=torch.long, device=device)
    active = torch.arange(batch, device=device)  # the sentences still in the batch, by index

    for step in range(max_len + 1):
        top_scores, from_beam, token = decoder.step(tokens[:, -1:], chooser(scores, step, max_len, min_len))
        is_eos = token == EOS

        # Finalize eos candidates among each sentence's first k, in rank order, up to k per sentence.
        take = is_eos[:, :k] & (top_scores[:, :k] > float("-inf"))
        slot = num_finished[active, None] + take.cumsum(1) - 1
        take &= slot < k
        b, c = take.nonzero(as_tuple=True)
        if len(b):
            sentence, place = active[b], slot[b, c]
            finished[sentence, place, :step] = tokens[b * k + from_beam[b, c], 1:]
            finished[sentence, place, step] = EOS
            finished_scores[sentence, place] = top_scores[b, c] / (step + 1) ** lenpen
            num_finished[active] += take.sum(1)
        running = num_finished[active] < k
        if not bool(running.any()):
            break

        # Continue with the k best candidates that are not eos (each beam offers at most one eos), in the
        # sentences still running.
        rank = torch.arange(2 * k, device=device).expand(len(active), -1)
        keep = torch.where(is_eos, rank + 2 * k, rank).argsort(dim=1)[:, :k][running]
        rows = torch.arange(len(active), device=device)[running, None] * k
        parents = (rows + from_beam[running].gather(1, keep)).view(-1)
        scores = top_scores[running].gather(1, keep)
        tokens = torch.cat([tokens[parents], token[running].gather(1, keep).view(-1, 1)], dim=1)
        shrink = not bool(running.all())
        active = active[running]
        decoder.reorder(parents, shrink)

    best_scores, best = finished_scores.max(dim=1)
    best_tokens = finished[torch.arange(batch, device=device), best].tolist()
    return [
        Hypothesis(row[: row.index(EOS)], score) for row, score in zip(best_tokens, best_scores.tolist(), strict=True)
    ]


class CachedRows:
    """What a StepDecoder keeps, moved as the search reorders rows: the decoder layers' cache, and per
    sentence (not per beam: the attention serves a sentence's beams from one copy) the source tokens
    (their padding mask) and the encoder output."""

    def __init__(self, cache: DecoderCache, src_tokens: torch.Tensor, encoder_out: torch.Tensor):
        self.cache, self.src_tokens, self.encoder_out = cache, src_tokens, encoder_out

    def reorder(self, rows: torch.Tensor, shrink: bool) -> None:
        if shrink:
            self.cache.select(rows)
            sentences = sentences_of(rows, self.cache.beam)
            self.src_tokens, self.encoder_out = self.src_tokens[sentences], self.encoder_out[sentences]
        else:
            self.cache.reorder(rows)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities in fp32, whatever the model's precision."""
    return F.log_softmax(logits.float(), dim=-1)


class ModelDecoder(CachedRows):
    """Decoding steps of the single-process Transformer, from the encoder output and a decoder cache."""

    def __init__(self, model: Transformer, src_tokens: torch.Tensor, beam: int):
        super().__init__(DecoderCache(len(model.decoder.layers), beam), src_tokens, model.encoder(src_tokens))
        self.model = model

    def step(self, tokens: torch.Tensor, choose: Choose) -> Candidates:
        hidden = self.model.decoder.features(tokens, self.encoder_out, self.src_tokens, self.cache)[:, -1]
        return choose(log_probs(self.model.decoder.output_projection.project(hidden)))


@torch.no_grad()
def beam_search(model: Transformer, src_tokens: torch.Tensor, cfg: SearchConfig, min_len: int = 1) -> list[Hypothesis]:
    """Best hypothesis per source sentence, decoded on the model's device (cfg.batch_size is the caller's
    batching). cfg.beam=1 is greedy decoding; eos is forbidden before min_len tokens."""
    model.eval()
    src_tokens = src_tokens.to(next(model.parameters()).device)
    decoder = ModelDecoder(model, src_tokens, cfg.beam)
    return search(decoder, src_tokens, model.cfg.max_positions, cfg, min_len)
