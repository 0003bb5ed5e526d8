"""Incremental beam search: exactly the full-recompute search's hypotheses and scores for every scheme,
greedy at beam 1, batch-independent, finished sentences leave the batch, exact on memorized pairs."""

import functools

import pytest
import torch

import fathom.model.cache
from fathom.corpus.batches import collate
from fathom.model import SCHEMES, ModelConfig, Transformer
from fathom.model.full_recompute_search import full_recompute_search
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import EOS
from fathom.model.schedule import ScheduleHook
from fathom.model.search import ModelDecoder, SearchConfig, beam_search, search


def tiny_model(seed=0, scheme="pre_ln", **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=3, embed_dim=32, ffn_dim=64, attention_heads=4, dropout=0.0,
        src_vocab_size=24, tgt_vocab_size=24, norm_scheme=scheme, schemes={"branchnorm": {"T": 10}}, **kw,
    )  # fmt: skip
    return Transformer(cfg).eval()


def trained_looking(scheme: str, seed: int = 0, **kw) -> Transformer:
    """A model whose scheme-specific parts are far from their initial values, as after training (Admin's
    omegas, ReZero's w, every LayerNorm), at BranchNorm alpha_t = 0.4."""
    model = tiny_model(seed, scheme, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "omega" in name or "_residual.weight" in name:
                p.copy_(torch.rand_like(p) * 2 + 0.2)
            elif "layer_norm" in name or "ffn_layernorm" in name or "inner_attn_ln" in name:
                p.add_(torch.randn_like(p) * 0.3)
    ScheduleHook(model)(4)
    return model


@functools.cache
def briefly_trained(scheme: str, **kw) -> Transformer:
    """A trained-looking model after 40 steps on random pairs of lengths 1-9: its sentences end at
    different steps (an untrained one mostly writes to the length limit, or stops at once)."""
    model = trained_looking(scheme, **kw).train()
    g = torch.Generator().manual_seed(0)
    lengths = torch.stack([torch.randint(1, 8, (32,), generator=g), torch.randint(1, 10, (32,), generator=g)], 1)
    pairs = [tuple(torch.randint(4, 24, (n,), generator=g) for n in pair) for pair in lengths.tolist()]
    fit(model, collate(pairs), steps=40)
    return model.eval()


def fit(model: Transformer, batch, steps: int) -> float:
    """Adam (lr 3e-3) on one batch for `steps` steps; the last loss (unsmoothed cross-entropy)."""
    (src, prev), target = batch
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = label_smoothed_cross_entropy(model(src, prev), target, smoothing=0.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def assert_ends_vary(hypotheses, limit: int) -> None:
    """The case the cache and the shrinking batch must get right: sentences ending at different steps."""
    lengths = [len(h.tokens) for h in hypotheses]
    assert len(set(lengths)) > 1 and min(lengths) < limit, lengths


def greedy(model, src, max_len):
    tokens = torch.tensor([[EOS]])
    for step in range(max_len):
        logits = model(src, tokens)[0, -1]
        if step == 0:  # the search's min_len=1 (fairseq's): no empty translation
            logits[EOS] = float("-inf")
        nxt = logits.argmax().item()
        if nxt == EOS:
            break
        tokens = torch.cat([tokens, torch.tensor([[nxt]])], dim=1)
    return tokens[0, 1:].tolist()


def fixed_limit(beam: int, max_len_b: int, lenpen: float = 0.6) -> SearchConfig:
    """A search whose output limit is max_len_b tokens whatever the source length."""
    return SearchConfig(beam=beam, lenpen=lenpen, max_len_a=0, max_len_b=max_len_b)


SOURCES = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 5], [14, 15, 16, 17], [6, 6, 9, 20, 21, 22], [7], [19, 18, 17, 16]]


def batch_of(sources):
    (src, _), _ = collate([(torch.tensor(s), torch.tensor([4])) for s in sources])
    return src


def assert_same_hypotheses(got, want):
    assert [h.tokens for h in got] == [h.tokens for h in want]
    torch.testing.assert_close(
        torch.tensor([h.score for h in got]), torch.tensor([h.score for h in want]), rtol=0, atol=1e-5
    )


@pytest.mark.slow
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_incremental_search_equals_full_recompute(scheme, beam):
    model, src = briefly_trained(scheme), batch_of(SOURCES)
    got = beam_search(model, src, fixed_limit(beam, 5))
    want = full_recompute_search(model, src, fixed_limit(beam, 5))
    assert_same_hypotheses(got, want)
    assert_ends_vary(want, 5)


@pytest.mark.slow
@pytest.mark.parametrize("share", ["all", "decoder+learned_pos"])
def test_incremental_search_with_shared_tables_and_learned_positions(share):
    model = briefly_trained(
        "post_ln",
        share_all_embeddings=share == "all",
        share_decoder_input_output_embed=share.startswith("decoder"),
        learned_pos=share.endswith("learned_pos"),
    )
    src = batch_of(SOURCES)
    want = full_recompute_search(model, src, fixed_limit(3, 5, lenpen=1.0))
    assert_same_hypotheses(beam_search(model, src, fixed_limit(3, 5, lenpen=1.0)), want)
    assert_ends_vary(want, 5)


@pytest.mark.slow
def test_caches_that_grow_mid_search(monkeypatch):
    """A cache starts with room for FIRST_CAPACITY positions and doubles it: growing while beams are
    re-ranked and sentences leave the batch keeps every prefix."""
    monkeypatch.setattr(fathom.model.cache, "FIRST_CAPACITY", 1)
    net, src = briefly_trained("pre_ln"), batch_of(SOURCES)
    want = full_recompute_search(net, src, fixed_limit(4, 9))
    assert_same_hypotheses(beam_search(net, src, fixed_limit(4, 9)), want)
    assert max(len(h.tokens) for h in want) > 2  # 4 positions fed: the caches grew from 2 to 6
    assert_ends_vary(want, 9)


class CountingDecoder(ModelDecoder):
    def __init__(self, *args):
        super().__init__(*args)
        self.rows = []

    def step(self, tokens, choose):
        self.rows.append(tokens.size(0))
        return super().step(tokens, choose)


@pytest.mark.slow
def test_finished_sentences_leave_the_batch():
    model, src = briefly_trained("post_ln"), batch_of(SOURCES)
    decoder = CountingDecoder(model, src, 4)
    hypotheses = search(decoder, src, model.cfg.max_positions, fixed_limit(4, 30))
    assert decoder.rows[0] == 4 * len(SOURCES)
    assert decoder.rows == sorted(decoder.rows, reverse=True) and decoder.rows[-1] < decoder.rows[0]
    assert_same_hypotheses(hypotheses, full_recompute_search(model, src, fixed_limit(4, 30)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_is_greedy(seed):
    model = tiny_model(seed)
    for tokens in SOURCES:
        src = torch.tensor([tokens + [EOS]])
        assert [h.tokens for h in beam_search(model, src, fixed_limit(1, 12, lenpen=1.0))] == [greedy(model, src, 12)]


def test_batched_equals_one_sentence_at_a_time():
    model = trained_looking("pre_ln", seed=3)
    batched = beam_search(model, batch_of(SOURCES), fixed_limit(4, 12))
    single = [beam_search(model, torch.tensor([s + [EOS]]), fixed_limit(4, 12))[0] for s in SOURCES]
    assert_same_hypotheses(batched, single)


def test_bf16_model_decodes_like_fp32():
    """bf16 weights decode on the same path (log-probabilities in fp32); on a small model the hypotheses
    agree with fp32's for most sentences (bf16 rounding may flip a near tie)."""
    model, src = trained_looking("pre_ln", seed=5), batch_of(SOURCES)
    fp32 = beam_search(model, src, fixed_limit(4, 12))
    bf16 = beam_search(model.to(torch.bfloat16), src, fixed_limit(4, 12))
    assert sum(a.tokens == b.tokens for a, b in zip(fp32, bf16, strict=True)) >= len(SOURCES) - 2


@pytest.mark.slow
def test_memorized_pairs_are_reproduced_exactly():
    pairs = [(s, [t + 1 for t in reversed(s)]) for s in SOURCES[:5]]
    model = tiny_model(4).train()
    batch = collate([(torch.tensor(s), torch.tensor(t)) for s, t in pairs])
    assert fit(model, batch, steps=300) < 0.01
    (src, _), _ = batch
    for beam in (1, 4):
        assert [h.tokens for h in beam_search(model, src, fixed_limit(beam, 200))] == [t for _, t in pairs]
