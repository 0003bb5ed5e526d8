"""Batched beam search: greedy at beam 1, batch-independent, and exact on memorized pairs."""

import pytest
import torch

from model import ModelConfig, Transformer
from model.config import EOS
from model.loss import label_smoothed_cross_entropy
from model.search import beam_search
from pipeline.data import collate


def tiny_model(seed=0, **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=2, embed_dim=32, ffn_dim=64, attention_heads=4, dropout=0.0,
        src_vocab_size=24, tgt_vocab_size=24, norm_scheme="pre_ln", **kw,
    )  # fmt: skip
    return Transformer(cfg).eval()


def greedy(model, src, max_len):
    tokens = torch.tensor([[EOS]])
    for _ in range(max_len):
        nxt = model(src, tokens)[0, -1].argmax().item()
        if nxt == EOS:
            break
        tokens = torch.cat([tokens, torch.tensor([[nxt]])], dim=1)
    return tokens[0, 1:].tolist()


SOURCES = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 5], [14, 15, 16, 17], [6, 6, 9, 20, 21, 22]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_is_greedy(seed):
    model = tiny_model(seed)
    for tokens in SOURCES:
        src = torch.tensor([tokens + [EOS]])
        assert beam_search(model, src, beam=1, max_len_b=12) == [greedy(model, src, 12)]


def test_batched_equals_one_sentence_at_a_time():
    model = tiny_model(3)
    (src, _), _ = collate([(torch.tensor(s), torch.tensor([4])) for s in SOURCES])
    batched = beam_search(model, src, beam=4, lenpen=0.6, max_len_b=12)
    single = [beam_search(model, torch.tensor([s + [EOS]]), beam=4, lenpen=0.6, max_len_b=12)[0] for s in SOURCES]
    assert batched == single


def test_memorized_pairs_are_reproduced_exactly():
    pairs = [(s, [t + 1 for t in reversed(s)]) for s in SOURCES]
    model = tiny_model(4).train()
    (src, prev), target = collate([(torch.tensor(s), torch.tensor(t)) for s, t in pairs])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = label_smoothed_cross_entropy(model(src, prev), target, smoothing=0.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.01
    for beam in (1, 4):
        assert beam_search(model, src, beam=beam, lenpen=0.6) == [t for _, t in pairs]
