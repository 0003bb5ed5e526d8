"""The specification of model/search.py: fathom's first beam search, which recomputes the whole decoder
over the whole prefix at every output position and keeps finished sentences in the batch.

Hypotheses are finalized like fairseq's SequenceGenerator: an eos among a sentence's top `beam`
candidates ends a hypothesis scored sum(log p) / length ** lenpen (length counting the eos), a
sentence is done after `beam` finalized hypotheses, and the best one wins. The incremental search
must give exactly its hypotheses and scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fathom.model.model_config import EOS, PAD
from fathom.model.search import Hypothesis, SearchConfig, max_length
from fathom.model.transformer import Transformer


@torch.no_grad()
def full_recompute_search(
    model: Transformer, src_tokens: torch.Tensor, cfg: SearchConfig, min_len: int = 1
) -> list[Hypothesis]:
    """Best hypothesis per source sentence (token ids ending before eos), on the CPU; model.search.beam_search's
    signature. cfg.beam=1 is greedy decoding."""
    model.eval()
    batch, k, lenpen = src_tokens.size(0), cfg.beam, cfg.lenpen
    max_len = max_length(src_tokens, model.cfg.max_positions, cfg)

    src = src_tokens.repeat_interleave(k, dim=0)
    encoder_out = model.encoder(src_tokens).repeat_interleave(k, dim=0)
    tokens = torch.full((batch * k, 1), EOS, dtype=torch.long)
    scores = torch.zeros(batch, k)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    finished = torch.full((batch, k, max_len + 1), PAD, dtype=torch.long)
    finished_scores = torch.full((batch, k), float("-inf"))
    num_finished = torch.zeros(batch, dtype=torch.long)
    rows = torch.arange(batch)[:, None]

    for step in range(max_len + 1):
        hidden = model.decoder.features(tokens, encoder_out, src)[:, -1]
        lprobs = F.log_softmax(model.decoder.output_projection.project(hidden).float(), dim=-1)
        lprobs[:, PAD] = float("-inf")
        if step < min_len:  # fairseq's default forbids the empty translation
            lprobs[:, EOS] = float("-inf")
        if step == max_len:  # out of room: only eos
            eos_column = lprobs[:, EOS].clone()
            lprobs.fill_(float("-inf"))
            lprobs[:, EOS] = eos_column
        vocab = lprobs.size(-1)
        candidates = (scores.view(-1, 1) + lprobs).view(batch, k * vocab)
        top_scores, top = candidates.topk(2 * k, dim=1)
        from_beam, token = top // vocab, top % vocab
        is_eos = token == EOS

        # Finalize eos candidates among each sentence's first k, in rank order, up to k per sentence.
        take = is_eos[:, :k] & (top_scores[:, :k] > float("-inf"))
        slot = num_finished[:, None] + take.cumsum(1) - 1
        take &= slot < k
        b, c = take.nonzero(as_tuple=True)
        if len(b):
            source_rows = b * k + from_beam[b, c]
            finished[b, slot[b, c], :step] = tokens[source_rows, 1:]
            finished[b, slot[b, c], step] = EOS
            finished_scores[b, slot[b, c]] = top_scores[b, c] / (step + 1) ** lenpen
            num_finished += take.sum(1)
        if bool((num_finished >= k).all()):
            break

        # Continue with the k best candidates that are not eos (each beam offers at most one eos).
        rank = torch.arange(2 * k).expand(batch, -1)
        keep = torch.where(is_eos, rank + 2 * k, rank).argsort(dim=1)[:, :k]
        scores = top_scores.gather(1, keep)
        parents = (rows * k + from_beam.gather(1, keep)).view(-1)
        tokens = torch.cat([tokens[parents], token.gather(1, keep).view(-1, 1)], dim=1)

    best_scores, best = finished_scores.max(dim=1)
    return [
        Hypothesis(row[: int((row == EOS).nonzero()[0])].tolist(), score)
        for row, score in zip(finished[torch.arange(batch), best], best_scores.tolist(), strict=True)
    ]
