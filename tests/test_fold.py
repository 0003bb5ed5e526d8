"""Folding each exportable scheme into a fairseq Post-LN / Pre-LN Transformer (model/fold.py)."""

import dataclasses

import pytest
import torch

from fathom.common.errors import ConfigError
from fathom.model import SCHEMES, ModelConfig
from fathom.model.embedding import Embedding, sinusoidal_table
from fathom.model.model_config import PAD
from fathom.model.schedule import ScheduleHook
from fathom.model.transformer import Transformer
from tests.helpers import fold_model

EXPORTABLE = [name for name, scheme in SCHEMES.items() if scheme.fairseq_layout is not None]
FOLDED = [name for name in EXPORTABLE if SCHEMES[name].fairseq_layout != name]  # whose scalings export folds away


def trained_looking(scheme: str, **kw) -> Transformer:
    """A model whose omegas and LayerNorms are far from their initial values, as after training."""
    cfg = ModelConfig(
        encoder_layers=3,
        decoder_layers=2,
        embed_dim=16,
        ffn_dim=32,
        attention_heads=2,
        src_vocab_size=40,
        tgt_vocab_size=40,
        norm_scheme=scheme,
        schemes={"branchnorm": {"T": 10}},
        **kw,
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "omega" in name:
                p.copy_(torch.rand_like(p) * 3 + 0.2)
            if "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    ScheduleHook(model)(3)  # BranchNorm's alpha_t = 0.3
    return model


def log_probs(model: Transformer, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(src, prev), dim=-1)[prev.ne(PAD)]


@pytest.mark.parametrize("share", ["none", "decoder", "all", "decoder+learned_pos"])
@pytest.mark.parametrize("scheme", EXPORTABLE)
def test_folded_model_computes_the_same(scheme, share):
    torch.manual_seed(0)
    model = trained_looking(
        scheme,
        share_all_embeddings=share == "all",
        share_decoder_input_output_embed=share.startswith("decoder"),
        learned_pos=share.endswith("learned_pos"),
    )
    folded = fold_model(model)
    assert folded.cfg.norm_scheme == SCHEMES[scheme].fairseq_layout
    assert not any("omega" in name for name, _ in folded.named_parameters())
    src, prev = torch.randint(4, 40, (3, 7)), torch.randint(4, 40, (3, 5))
    src[0, :2] = PAD
    difference = (log_probs(model, src, prev) - log_probs(folded, src, prev)).abs().max().item()
    # DeepNorm's first sublayers fold through LayerNorm's scale invariance, which moves its eps
    assert difference < (1e-5 if scheme == "deepnorm" else 2e-6)


def test_folding_is_not_the_identity():
    """The schemes' scalings matter: the trained weights read as a Post-LN model compute something else."""
    torch.manual_seed(0)
    for scheme in FOLDED:
        model = trained_looking(scheme)
        unfolded = Transformer(dataclasses.replace(model.cfg, norm_scheme="post_ln", schemes={})).eval()
        unfolded.load_state_dict(model.state_dict(), strict=False)
        src, prev = torch.randint(4, 40, (2, 6)), torch.randint(4, 40, (2, 5))
        assert (log_probs(model, src, prev) - log_probs(unfolded, src, prev)).abs().max() > 0.01, scheme


def test_admin_folds_its_first_omega_into_learned_positions():
    torch.manual_seed(0)
    model = trained_looking("admin", share_all_embeddings=True)
    folded = fold_model(model)
    assert folded.cfg.learned_pos and not folded.cfg.share_all_embeddings
    omega = model.encoder.layers[0].self_attn_residual.omega
    rows = folded.encoder.embed_tokens.positions.weight
    assert torch.allclose(rows, sinusoidal_table(len(rows), 16) * omega.detach())
    # the output projection keeps the unscaled table
    assert torch.equal(folded.decoder.output_projection.weight, model.encoder.embed_tokens.weight)


def test_a_zero_omega_cannot_be_folded():
    model = trained_looking("admin")
    with torch.no_grad():
        model.decoder.layers[1].ffn_residual.omega[3] = 0.0
    with pytest.raises(ConfigError, match="entry near 0"):
        fold_model(model)


def test_learned_positions_follow_fairseq():
    """Rows from padding_idx + 1 on, pad row zero, as fairseq's LearnedPositionalEmbedding."""
    emb = Embedding(10, 8, learned_positions=20).eval()
    assert emb.positions.weight.shape == (20 + PAD + 1, 8)
    assert torch.equal(emb.positions.weight[PAD], torch.zeros(8))
    tokens = torch.tensor([[PAD, 5, 6]])
    expected = emb.scale * emb.weight[tokens] + emb.positions.weight[torch.tensor([[PAD, 2, 3]])]
    assert torch.allclose(emb.embed(tokens), expected)


def test_learned_positions_cannot_be_shared_between_stacks():
    with pytest.raises(ConfigError, match="model.learned_pos: .* share one position table"):
        ModelConfig(learned_pos=True, share_all_embeddings=True, src_vocab_size=8, tgt_vocab_size=8)
