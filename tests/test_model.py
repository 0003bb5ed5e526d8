"""The building blocks against fairseq's definitions, and the data stream's determinism."""

import math

import pytest
import torch
import torch.nn.functional as F

from fathom.corpus.batches import BatchSize, MicroBatches, SyntheticConfig, SyntheticTranslation, collate
from fathom.model.dropout import Dropout, keep_mask
from fathom.model.embedding import Embedding, positions_of, sinusoidal_table
from fathom.model.layers import MultiheadAttention, attention
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import EOS, NUM_SPECIAL, PAD, ModelConfig
from fathom.model.parts import build_parts, model_parts
from fathom.model.transformer import Transformer
from fathom.pipeline.parts.stage_modules import pipe_parts


def test_attention_equals_softmax_formula_with_padding_mask():
    torch.manual_seed(0)
    attn = MultiheadAttention(16, 4).eval()
    q, kv = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)

    def heads(x):
        return x.view(2, -1, 4, 4).transpose(1, 2)

    scores = heads(attn.q_proj(q)) @ heads(attn.k_proj(kv)).transpose(-1, -2) / math.sqrt(4)
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ heads(attn.v_proj(kv))).transpose(1, 2).reshape(2, 3, 16)
    torch.testing.assert_close(attn(q, kv, keep[:, None, None, :]), attn.out_proj(out), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["padding", "causal"])
def test_bf16_attention_on_a_cpu_equals_the_fused_kernel(kind):
    """bf16 on a CPU takes two matmuls around a float32 softmax instead of torch's fused kernel (3x faster
    here): the same attention as the fused kernel in float32 on the same inputs, forward and backward, to
    bf16's precision."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 7, 16).bfloat16() for _ in range(3))
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 2 + [0] * 5], dtype=torch.bool)[:, None, None, :]
    mask, causal = (mask, False) if kind == "padding" else (None, True)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention(*inputs, mask, 0.0, causal)
        (out.float() * torch.linspace(-1, 1, 16)).sum().backward()
        results.append([out.float(), *(t.grad.float() for t in inputs)])
    for ours, fused in zip(*results, strict=True):
        torch.testing.assert_close(ours, fused, rtol=0.02, atol=0.02)


def test_causal_attention_ignores_the_future():
    torch.manual_seed(0)
    attn = MultiheadAttention(8, 2).eval()
    x = torch.randn(1, 6, 8)
    changed = x.clone()
    changed[:, 4:] += 1.0
    a, b = attn(x, x, causal=True), attn(changed, changed, causal=True)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_sinusoidal_table_is_fairseqs():
    table = sinusoidal_table(6, 8)
    half = 4
    freq = math.log(10000) / (half - 1)
    pos, i = 3, 2
    assert table[pos, i].item() == pytest.approx(math.sin(pos * math.exp(-i * freq)), abs=1e-6)
    assert table[pos, half + i].item() == pytest.approx(math.cos(pos * math.exp(-i * freq)), abs=1e-6)
    assert torch.all(table[PAD] == 0)


def test_positions_skip_padding_on_either_side():
    right = torch.tensor([[7, 8, 9, PAD, PAD]])
    left = torch.tensor([[PAD, PAD, 7, 8, 9]])
    assert positions_of(right).tolist() == [[2, 3, 4, 1, 1]]
    assert positions_of(left).tolist() == [[1, 1, 2, 3, 4]]


def test_embedding_scales_by_sqrt_dim_and_adds_positions():
    emb = Embedding(10, 8).eval()
    tokens = torch.tensor([[5, 6, PAD]])
    expected = math.sqrt(8) * emb.weight[tokens] + sinusoidal_table(4, 8)[positions_of(tokens)]
    torch.testing.assert_close(emb.embed(tokens), expected)
    assert torch.all(emb.weight[PAD] == 0)


def test_label_smoothing_is_fairseqs_and_ignores_padding():
    torch.manual_seed(0)
    logits, target = torch.randn(2, 3, 7), torch.tensor([[4, 5, PAD], [6, 2, 3]])
    lprobs = logits.log_softmax(-1)
    keep = target.ne(PAD)
    nll = -lprobs.gather(-1, target[..., None]).squeeze(-1)[keep]
    smooth = -lprobs.sum(-1)[keep]
    eps, eps_i = 0.1, 0.1 / 6
    expected = ((1 - eps - eps_i) * nll + eps_i * smooth).mean()
    assert label_smoothed_cross_entropy(logits, target, 0.1).item() == pytest.approx(expected.item(), abs=1e-6)
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD)
    assert label_smoothed_cross_entropy(logits, target, 0.0).item() == pytest.approx(ce.item(), abs=1e-6)


def test_synthetic_target_is_the_reversed_cipher():
    corpus = SyntheticTranslation(SyntheticConfig(words=10, sentences=50))
    src, tgt = corpus.pair(3)
    assert tgt.tolist() == [corpus.cipher[w - NUM_SPECIAL].item() for w in reversed(src.tolist())]
    assert corpus.src_vocab_size == NUM_SPECIAL + 10


def test_collate_uses_fairseqs_layout():
    (src, prev), target = collate(
        [(torch.tensor([5, 6]), torch.tensor([7, 8, 9])), (torch.tensor([5]), torch.tensor([7]))]
    )
    assert src.tolist() == [[5, 6, EOS], [5, EOS, PAD]]
    assert target.tolist() == [[7, 8, 9, EOS], [7, EOS, PAD, PAD]]
    assert prev.tolist() == [[EOS, 7, 8, 9], [EOS, 7, PAD, PAD]]


@pytest.mark.parametrize("ranks", [1, 2])
def test_micro_batches_resume_at_any_step(ranks):
    corpus = SyntheticTranslation(SyntheticConfig(sentences=100))
    for rank in range(ranks):
        stream = MicroBatches(corpus, BatchSize(sentences=8), seed=5, data_parallel_rank=rank, data_parallel_size=ranks)
        uninterrupted = [next(stream) for _ in range(3 * 7)]  # 7 steps: crosses the epoch of 12 batches
        resumed = MicroBatches(
            corpus,
            BatchSize(sentences=8),
            seed=5,
            start=4 * 3 * ranks,
            data_parallel_rank=rank,
            data_parallel_size=ranks,
        )
        for expected in uninterrupted[12:]:
            got = next(resumed)
            assert torch.equal(got[0][0], expected[0][0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("share", ["none", "decoder", "all"])
def test_the_model_and_the_pipeline_are_built_from_the_same_parts(share):
    """The single-process Transformer holds every part under the part's name, a shared table as one
    module under each of its names, and nothing else; the pipe (pipeline) form of a part has the same
    parameters by name and shape, so one checkpoint file loads into either."""
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=3, embed_dim=8, ffn_dim=16, attention_heads=2, src_vocab_size=16,
        tgt_vocab_size=16, norm_scheme="pre_ln", share_all_embeddings=share == "all",
        share_decoder_input_output_embed=share == "decoder",
    )  # fmt: skip
    parts, model = model_parts(cfg), Transformer(cfg)
    modules = [model.get_submodule(part.name) for part in parts]
    tables = {part.tie for part in parts if part.tie is not None}
    assert len({id(module) for module in modules}) == len(parts) - sum(not part.saved for part in parts)
    assert len(tables) == {"none": 0, "decoder": 1, "all": 1}[share]
    saved = [part for part in parts if part.saved]
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for part in saved for p in model.get_submodule(part.name).parameters()
    )
    for part, pipe in zip(parts, build_parts(pipe_parts(cfg)), strict=True):
        module = model.get_submodule(part.name)
        assert isinstance(pipe, type(module))
        assert {k: v.shape for k, v in pipe.state_dict().items()} == {
            k: v.shape for k, v in module.state_dict().items()
        }


def test_dropout_keeps_each_element_with_probability_1_minus_p_and_rescales():
    """fathom's CPU dropout (16-bit slices of 64-bit random integers, not bernoulli_): the fraction kept is
    1 - p, kept elements are scaled by 1 / (1 - p) so the mean is unchanged, the gradient flows through the
    same mask, and evaluation is the identity."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        dropout = Dropout(0.3).train()
        x = torch.ones(400, 501, dtype=dtype, requires_grad=True)  # not a multiple of 4 elements
        y = dropout(x)
        kept = y.ne(0)
        assert abs(kept.float().mean().item() - 0.7) < 0.005
        torch.testing.assert_close(y[kept].float(), torch.full((int(kept.sum()),), 1 / 0.7), rtol=0.01, atol=0)
        y.sum().backward()
        assert torch.equal(x.grad.ne(0), kept)
        assert dropout.eval()(x) is x


def test_dropout_masks_are_independent_between_neighbours_and_follow_the_seed():
    """Four neighbouring elements share one 64-bit draw: each of the four positions, and each pair of
    neighbours, must still be kept at 1 - p and (1 - p)^2, or a sign bit left at 0 would show here."""
    torch.manual_seed(1)
    keep = keep_mask(torch.Size([1 << 20]), 0.5).view(-1, 4).float()
    for position in range(4):
        assert abs(keep[:, position].mean().item() - 0.5) < 0.005
    for a, b in ((0, 1), (1, 2), (2, 3), (3, 0)):
        assert abs((keep[:, a] * keep[:, b]).mean().item() - 0.25) < 0.005
    assert abs(keep_mask(torch.Size([1 << 20]), 0.1).float().mean().item() - 0.9) < 0.002
    torch.manual_seed(2)
    first = keep_mask(torch.Size([3, 5]), 0.3)
    torch.manual_seed(2)
    assert torch.equal(keep_mask(torch.Size([3, 5]), 0.3), first)
