"""Numerical parity with torchscale's EncoderDecoder (pip torchscale 0.3.0): with the same weights,
our DeepNorm and Sub-LN models compute torchscale's logits."""

import re
import sys
import types

import pytest
import torch

from model import ModelConfig, Transformer
from model.embedding import sinusoidal_table

VOCAB, DIM, MAX_POSITIONS = 40, 32, 16


def _drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    assert drop_prob == 0.0, "the parity models use drop_path_rate 0"
    return x


def import_torchscale() -> types.SimpleNamespace:
    """torchscale imports timm for drop_path alone, unused at drop_path_rate 0, and timm would pull
    torchvision and with it a CUDA torch; so `make install` installs torchscale without dependencies
    and, when timm is absent, this stands in for that one function."""
    try:
        import timm.models.layers  # noqa: F401
    except ImportError:
        layers = types.ModuleType("timm.models.layers")
        layers.drop_path = _drop_path
        sys.modules.update({"timm": types.ModuleType("timm"), "timm.models": types.ModuleType("timm.models")})
        sys.modules["timm.models.layers"] = layers
    try:
        from torchscale.architecture.config import EncoderDecoderConfig
        from torchscale.architecture.encoder_decoder import EncoderDecoder
        from torchscale.component.embedding import PositionalEmbedding, TextEmbedding
    except ImportError as err:
        pytest.skip(f"torchscale is not importable ({err}); `make install` installs it")
    return types.SimpleNamespace(
        Config=EncoderDecoderConfig, Model=EncoderDecoder, Positions=PositionalEmbedding, Text=TextEmbedding
    )


def torchscale_model(ts: types.SimpleNamespace, scheme: str, n: int, m: int, dim: int = DIM) -> torch.nn.Module:
    args = ts.Config(
        encoder_embed_dim=dim, encoder_attention_heads=4, encoder_ffn_embed_dim=2 * dim, encoder_layers=n,
        decoder_embed_dim=dim, decoder_attention_heads=4, decoder_ffn_embed_dim=2 * dim, decoder_layers=m,
        activation_fn="relu", no_scale_embedding=False, vocab_size=VOCAB, share_all_embeddings=True,
        deepnorm=scheme == "deepnorm", subln=scheme == "sub_ln",
    )  # fmt: skip
    embed = ts.Text(VOCAB, dim, padding_idx=1)

    def positions() -> torch.nn.Module:  # fairseq's sinusoids, ours, as a fixed table
        table = ts.Positions(MAX_POSITIONS, dim)
        table.weight.data.copy_(sinusoidal_table(MAX_POSITIONS, dim))
        return table

    return ts.Model(args, embed, positions(), embed, positions())


def torchscale_name(name: str) -> str:
    """Our parameter names are fairseq's; torchscale groups the FFN under `ffn.`."""
    return re.sub(r"(layers\.\d+\.)(fc1|fc2|ffn_layernorm)", r"\1ffn.\2", name)


@pytest.mark.parametrize("scheme", ["deepnorm", "sub_ln"])
@pytest.mark.parametrize("n, m", [(3, 2), (6, 6)])
def test_same_weights_give_torchscales_outputs(scheme, n, m):
    ts = import_torchscale()
    torch.manual_seed(0)
    cfg = ModelConfig(
        encoder_layers=n, decoder_layers=m, embed_dim=DIM, ffn_dim=2 * DIM, attention_heads=4, dropout=0.0,
        share_all_embeddings=True, norm_scheme=scheme, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
        schemes={"deepnorm": {"init": "torchscale"}},
    )  # fmt: skip
    ours = Transformer(cfg).eval()
    with torch.no_grad():  # LayerNorm gains and biases away from 1 and 0, so a misplaced one shows
        for name, param in ours.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    theirs = torchscale_model(ts, scheme, n, m).eval()
    state = {torchscale_name(k): v for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert unexpected == [] and sorted(missing) == ["decoder.embed_positions.weight", "encoder.embed_positions.weight"]

    src = torch.randint(4, VOCAB, (3, 9))  # no padding: torchscale takes its padding mask as an argument
    prev = torch.randint(4, VOCAB, (3, 7))
    with torch.no_grad():
        expected = theirs(src, prev)[0]
        got = ours(src, prev)
    assert got.shape == expected.shape == (3, 7, VOCAB)
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("scheme", ["deepnorm", "sub_ln"])
def test_torchscale_init_has_torchscales_weight_scales(scheme):
    """model.deepnorm.init = torchscale (and Sub-LN's init) draw every weight matrix and bias at the
    scale torchscale's own constructor does; the draws differ, so compare standard deviations."""
    ts = import_torchscale()
    torch.manual_seed(0)
    n, m, dim = 6, 4, 256
    cfg = ModelConfig(
        encoder_layers=n, decoder_layers=m, embed_dim=dim, ffn_dim=2 * dim, attention_heads=4,
        share_all_embeddings=True, norm_scheme=scheme, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
        schemes={"deepnorm": {"init": "torchscale"}},
    )  # fmt: skip
    ours = dict(Transformer(cfg).named_parameters())
    theirs = dict(torchscale_model(ts, scheme, n, m, dim).named_parameters())
    checked = 0
    for name, param in ours.items():
        if "embed" not in name:
            # a bias has only 256 or 512 draws: its std is known to about 6%
            rel = 0.05 if param.dim() == 2 else 0.2
            assert param.std().item() == pytest.approx(theirs[torchscale_name(name)].std().item(), rel=rel), name
            checked += 1
    assert checked == len(theirs) - 3  # all but the shared token embedding and the two position tables
