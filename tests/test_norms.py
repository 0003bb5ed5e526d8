"""Each norm scheme against its paper's formulas."""

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from fathom.common.errors import ConfigError
from fathom.common.sections import APPLIED, START_ONLY, OnResume
from fathom.model import SCHEMES, ModelConfig, NormScheme
from fathom.model.layers import SUBLAYERS, DecoderLayer, EncoderLayer
from fathom.model.norms import branchnorm_alpha, build_scheme, deepnorm_constants, sub_ln_gain, t_fixup_scale
from fathom.model.schedule import ScheduleHook
from fathom.model.transformer import Transformer
from fathom.pipeline.config.resume_rules import settings_with


def config(scheme: str, **kw) -> ModelConfig:
    base = dict(encoder_layers=3, decoder_layers=2, embed_dim=32, ffn_dim=64, attention_heads=4, dropout=0.0)
    base.update(src_vocab_size=30, tgt_vocab_size=30)
    base.update(kw)
    return ModelConfig(norm_scheme=scheme, **base)


# Hand-computed from the DeepNet paper's encoder-decoder table:
# encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16); decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4).
@pytest.mark.parametrize(
    "n, m, enc_alpha, enc_beta, dec_alpha, dec_beta",
    [
        (6, 6, 1.41794, 0.49699, 2.05977, 0.34329),
        (18, 18, 1.99875, 0.35257, 2.71081, 0.26085),
        (100, 100, 3.41574, 0.20631, 4.16179, 0.16990),
        (60, 12, 2.63313, 0.26763, 2.44949, 0.28868),
    ],
)
def test_deepnorm_constants(n, m, enc_alpha, enc_beta, dec_alpha, dec_beta):
    assert deepnorm_constants(n, m, "encoder") == pytest.approx((enc_alpha, enc_beta), abs=1e-5)
    assert deepnorm_constants(n, m, "decoder") == pytest.approx((dec_alpha, dec_beta), abs=1e-5)


def test_deepnorm_beta_scales_exactly_v_out_fc1_fc2():
    torch.manual_seed(0)
    cfg = config("deepnorm", encoder_layers=100, decoder_layers=100, embed_dim=256, ffn_dim=1024, attention_heads=4)
    layer = DecoderLayer(cfg, build_scheme(cfg))
    _, beta = deepnorm_constants(100, 100, "decoder")

    def xavier_std(w):
        return math.sqrt(2.0 / sum(w.shape))

    for name, param in layer.named_parameters():
        if not name.endswith("weight") or param.dim() != 2:
            continue
        leaf = name.split(".")[-2]
        expected = xavier_std(param) * (beta if leaf in ("v_proj", "out_proj", "fc1", "fc2") else 1.0)
        assert param.std().item() == pytest.approx(expected, rel=0.05), name
    assert torch.equal(layer.self_attn_layer_norm.weight, torch.ones(256))


def params_beside_default_init(layer_cls, cfg: ModelConfig) -> tuple[dict, dict]:
    """A layer's parameters and, built from the same seed, those of a default-initialized (Post-LN) layer."""
    torch.manual_seed(0)
    params = dict(layer_cls(cfg, build_scheme(cfg)).named_parameters())
    torch.manual_seed(0)
    post_ln = dataclasses.replace(cfg, norm_scheme="post_ln")
    return params, dict(layer_cls(post_ln, build_scheme(post_ln)).named_parameters())


# Hand-computed for N=3, M=2. DeepNorm (torchscale): encoder beta 1.15 (N^4 M)^(-1/16) (the paper: 0.87),
# decoder (12M)^(-1/4). Sub-LN: encoder gamma sqrt(ln(3M) ln(2N) / 3), decoder sqrt(ln(3M)).
TORCHSCALE_FACTORS = [
    ("deepnorm", EncoderLayer, 0.83677),
    ("deepnorm", DecoderLayer, 0.45180),
    ("sub_ln", EncoderLayer, 1.03447),
    ("sub_ln", DecoderLayer, 1.33857),
]


@pytest.mark.parametrize("scheme, layer_cls, factor", TORCHSCALE_FACTORS)
def test_torchscale_inits_scale_pytorch_defaults(scheme, layer_cls, factor):
    """torchscale's code: every projection at PyTorch's nn.Linear default, U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    for weights and biases, then v_proj, out_proj, fc1, fc2 (not Sub-LN's cross-attention) times the factor."""
    side = "encoder" if layer_cls is EncoderLayer else "decoder"
    constant = deepnorm_constants(3, 2, side, "torchscale")[1] if scheme == "deepnorm" else sub_ln_gain(3, 2, side)
    assert constant == pytest.approx(factor, abs=1e-5)
    torch.manual_seed(0)
    cfg = config(scheme, embed_dim=256, ffn_dim=512, schemes={"deepnorm": {"init": "torchscale"}})
    for name, module in layer_cls(cfg, build_scheme(cfg)).named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        scaled = name.split(".")[-1] in ("v_proj", "out_proj", "fc1", "fc2")
        scaled = scaled and not (scheme == "sub_ln" and name.startswith("encoder_attn"))
        bound = (factor if scaled else 1.0) / math.sqrt(module.in_features)
        for param in (module.weight, module.bias):
            assert param.abs().max().item() <= bound * (1 + 1e-5), name
        assert module.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03), name
        assert module.bias.abs().max().item() > 0.9 * bound, name  # drawn, not fairseq's zeros


def test_deepnorm_init_must_be_paper_or_torchscale():
    with pytest.raises(ConfigError, match="model.deepnorm.init: 'xavier'; choose one of paper, torchscale"):
        Transformer(config("deepnorm", schemes={"deepnorm": {"init": "xavier"}}))


def written_attention(mha, query: torch.Tensor, key_value: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Softmax attention written out, with Sub-LN's LayerNorm before out_proj where the module has one."""
    heads = mha.num_heads

    def split(t):
        return t.view(t.size(0), t.size(1), heads, -1).transpose(1, 2)

    q, k, v = split(mha.q_proj(query)), split(mha.k_proj(key_value)), split(mha.v_proj(key_value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return mha.out_proj(mha.inner_attn_ln((torch.softmax(scores, dim=-1) @ v).transpose(1, 2).flatten(2)))


@pytest.mark.parametrize(
    "layer_cls, side, hand_scale", [(EncoderLayer, "encoder", 0.50909), (DecoderLayer, "decoder", 0.48549)]
)
def test_t_fixup_init_scales_v_out_and_xavier_ffn(layer_cls, side, hand_scale):
    """T-Fixup for N=3, M=2: encoder 0.67 N^(-1/4), decoder (9M)^(-1/4); v_proj starts from gain-1 xavier."""
    scale = t_fixup_scale(3, 2, side)
    assert scale == pytest.approx(hand_scale, abs=1e-5)
    fixup, default = params_beside_default_init(layer_cls, config("t_fixup", embed_dim=64, ffn_dim=256))
    assert not any("layer_norm" in name for name in fixup)
    for name, param in fixup.items():
        leaf = name.split(".")[-2]
        if leaf in ("fc1", "fc2"):
            xavier_bound = math.sqrt(6 / sum(param.shape)) if param.dim() == 2 else 0.0
            assert param.abs().max().item() <= scale * xavier_bound, name
            if param.dim() == 2:
                assert param.std().item() == pytest.approx(scale * xavier_bound / math.sqrt(3), rel=0.05), name
            continue
        factor = {"v_proj": scale * math.sqrt(2), "out_proj": scale}.get(leaf, 1.0) if name.endswith("weight") else 1
        torch.testing.assert_close(param, factor * default[name], rtol=1e-6, atol=0, msg=name)


def test_t_fixup_scales_token_embeddings_per_side():
    def embedding_std(**kw):
        torch.manual_seed(0)
        model = Transformer(config("t_fixup", src_vocab_size=2000, tgt_vocab_size=2000, **kw))
        return [e.weight[4:].std().item() for e in (model.encoder.embed_tokens, model.decoder.embed_tokens)]

    default_std = 32**-0.5
    assert embedding_std() == pytest.approx([0.43869 * default_std, 0.48549 * default_std], rel=0.03)  # (9*3), (9*2)
    assert embedding_std(share_all_embeddings=True) == pytest.approx([0.43869 * default_std] * 2, rel=0.03)


def sublayers(layer, encoder_out: torch.Tensor | None) -> list[tuple]:
    """(F, the LayerNorm beside it, its residual module) of each sublayer in order, written out."""

    def ffn(h):
        return layer.fc2(layer.ffn_layernorm(F.relu(layer.fc1(h))))

    if encoder_out is None:
        attention = [(lambda h: written_attention(layer.self_attn, h, h), layer.self_attn_layer_norm,
                      layer.self_attn_residual)]  # fmt: skip
    else:
        attention = [
            (lambda h: written_attention(layer.self_attn, h, h, causal=True), layer.self_attn_layer_norm,
             layer.self_attn_residual),
            (lambda h: written_attention(layer.encoder_attn, h, encoder_out), layer.encoder_attn_layer_norm,
             layer.encoder_attn_residual),
        ]  # fmt: skip
    return [*attention, (ffn, layer.final_layer_norm, layer.ffn_residual)]


def written_layer(layer, x: torch.Tensor, formula: str, a: float = 1.0, encoder_out=None) -> torch.Tensor:
    """The paper's formula for each scheme, applied sublayer by sublayer over the layer's own modules."""
    for branch, ln, residual in sublayers(layer, encoder_out):
        if formula == "pre":  # Pre-LN, and Sub-LN (whose extra LayerNorms sit inside F)
            x = x + branch(ln(x))
        elif formula == "no_ln":  # T-Fixup: x + F(x), no LayerNorm
            x = x + branch(x)
        elif formula == "rezero":  # x + w F(x), no LayerNorm
            x = x + residual.weight * branch(x)
        elif formula == "admin":  # LN(x * omega + F(x)), omega a vector per sublayer
            x = ln(x * residual.omega + branch(x))
        elif formula == "post_alpha":  # DeepNorm: LN(alpha * x + F(x))
            x = ln(a * x + branch(x))
        else:  # BranchNorm: LN(x + alpha_t F(x)); Post-LN is alpha_t = 1
            x = ln(x + a * branch(x))
    return x


@pytest.mark.parametrize("side", ["encoder", "decoder"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_layer_follows_formula(scheme, side):
    torch.manual_seed(0)
    cfg = config(scheme, schemes={"branchnorm": {"T": 8}})
    layer = (EncoderLayer if side == "encoder" else DecoderLayer)(cfg, build_scheme(cfg)).eval()
    ScheduleHook(layer)(2)
    x = torch.randn(2, 5, 32)
    src = torch.randint(4, 30, (2, 5 if side == "encoder" else 6))  # no padding
    encoder_out = None if side == "encoder" else torch.randn(2, 6, 32)
    formula, a = {
        "pre_ln": ("pre", 1.0),
        "sub_ln": ("pre", 1.0),
        "deepnorm": ("post_alpha", deepnorm_constants(3, 2, side)[0]),
        "branchnorm": ("post", 0.25),  # alpha_t at t = 2 of T = 8
        "t_fixup": ("no_ln", 1.0),
        "rezero": ("rezero", 1.0),
        "admin": ("admin", 1.0),
    }.get(scheme, ("post", 1.0))
    with torch.no_grad():
        for _, _, residual in sublayers(layer, encoder_out):
            if scheme == "rezero":  # away from the initial 0, where every branch is invisible
                residual.weight.uniform_(-1.0, 1.0)
            if scheme == "admin":  # as a profiling pass leaves them: away from 1, where Admin is Post-LN
                residual.omega.uniform_(0.5, 2.0)
    expected = written_layer(layer, x, formula, a, encoder_out)
    got = layer(x, src) if side == "encoder" else layer(x, encoder_out, src)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_rezero_starts_as_the_identity_without_layer_norms():
    torch.manual_seed(0)
    model = Transformer(config("rezero"))
    weights = {k: v for k, v in model.state_dict().items() if k.endswith("_residual.weight")}
    assert len(weights) == 3 * 2 + 2 * 3  # encoder: attention + FFN; decoder: + cross-attention
    assert all(torch.equal(w, torch.zeros(1)) for w in weights.values())
    assert not any("layer_norm" in k for k in model.state_dict())
    layer = model.encoder.layers[0].eval()
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(layer(x, torch.randint(4, 30, (2, 5))), x, rtol=0, atol=0)


@pytest.mark.parametrize("step", [1, 6, 12])
def test_branchnorm_at_depth_follows_its_formula_in_every_sublayer(step):
    """BranchNorm has no reference implementation to train beside (the depth study's control, round 3): at
    the study's 25L-25L d64 with T = 12, at steps 1, T/2 and T, every sublayer of both stacks, run on the input
    the stack gives it, is LN(x + alpha_t F(x)) with Eq. 8's alpha_t = min(1, t/T)."""
    torch.manual_seed(0)
    cfg = config("branchnorm", encoder_layers=25, decoder_layers=25, embed_dim=64, ffn_dim=256,
                 schemes={"branchnorm": {"T": 12}})  # fmt: skip
    model = Transformer(cfg).eval()
    ScheduleHook(model)(step)
    alpha = min(1.0, step / 12)
    src, prev = torch.randint(4, 30, (2, 7)), torch.randint(4, 30, (2, 6))  # no padding
    with torch.no_grad():
        x = model.encoder.embed_tokens.embed(src)
        for layer in model.encoder.layers:
            expected = written_layer(layer, x, "post", alpha)
            x = layer(x, src)
            torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
        encoder_out, y = x, model.decoder.embed_tokens.embed(prev)
        for layer in model.decoder.layers:
            expected = written_layer(layer, y, "post", alpha, encoder_out)
            y = layer(y, encoder_out, src)
            torch.testing.assert_close(y, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(src, prev), model.decoder.output_projection.project(y), rtol=0, atol=0)


def test_branchnorm_at_alpha_one_equals_post_ln():
    torch.manual_seed(0)
    branch = Transformer(config("branchnorm", schemes={"branchnorm": {"T": 10}})).eval()
    post = Transformer(config("post_ln")).eval()
    post.load_state_dict(branch.state_dict())
    src, prev = torch.randint(4, 30, (3, 7)), torch.randint(4, 30, (3, 6))
    ScheduleHook(branch)(10)
    torch.testing.assert_close(branch(src, prev), post(src, prev), rtol=0, atol=0)
    ScheduleHook(branch)(5)
    assert not torch.allclose(branch(src, prev), post(src, prev))


@pytest.mark.parametrize(
    "growth, values",
    [
        ("linear", [0.0, 0.25, 0.5, 1.0, 1.0]),
        ("exp", [0.0, 0.01689, 0.07586, 1.0, 1.0]),
        ("sigmoid", [0.0, 0.07010, 0.5, 1.0, 1.0]),
    ],
)
def test_branchnorm_alpha_growth(growth, values):
    steps = [0, 1000, 2000, 4000, 9000]
    assert [branchnorm_alpha(s, 4000, growth) for s in steps] == pytest.approx(values, abs=1e-5)
    curve = [branchnorm_alpha(s, 4000, growth) for s in range(0, 4001, 50)]
    assert curve == sorted(curve)


def test_branchnorm_default_is_the_papers():
    scheme = SCHEMES["branchnorm"](config("branchnorm"))
    assert scheme.options.T == 4000 and scheme.options.growth == "linear"
    assert scheme.alpha(400) == pytest.approx(0.1)


def test_pre_ln_has_final_layer_norms_and_post_ln_not():
    assert Transformer(config("pre_ln")).encoder.layer_norm is not None
    names = Transformer(config("post_ln")).state_dict()
    assert not any(k.startswith(("encoder.layer_norm", "decoder.layer_norm")) for k in names)


def test_a_scheme_declares_the_options_a_resume_may_not_change(monkeypatch):
    """A resume refuses a changed setting that acts only at a run's start; a scheme's such option is
    declared on its Options field, and nothing else lists it."""

    class Profiled(NormScheme):
        name = "profiled_test"

        @dataclass
        class Options:
            warmup: int = field(default=0, metadata=START_ONLY)
            scale: float = field(default=1.0, metadata=APPLIED)

    monkeypatch.setitem(SCHEMES, Profiled.name, Profiled)
    settings = settings_with(OnResume.START_ONLY)
    assert {"train.init_from", "train.init_step", "model.admin.profile", "model.profiled_test.warmup"} <= set(settings)
    assert "model.profiled_test.scale" not in settings


@pytest.mark.parametrize("scheme", ["post_ln", "admin", "sub_ln"])
@pytest.mark.parametrize("layer_cls", [EncoderLayer, DecoderLayer])
def test_sublayers_declares_each_layers_modules_in_the_order_forward_meets_them(scheme, layer_cls):
    """Admin's profile and export's fold walk a layer by model.layers.SUBLAYERS, not by their own tables."""
    cfg = config(scheme)
    layer = layer_cls(cfg, build_scheme(cfg)).eval()
    declared = SUBLAYERS[layer.side]
    residuals = [name for name, _ in layer.named_children() if name.endswith("_residual")]
    assert sorted(residuals) == sorted(sublayer.residual for sublayer in declared)
    for sublayer in declared:
        for name in (sublayer.layer_norm, *sublayer.inputs, sublayer.output):
            layer.get_submodule(name)  # raises for a name the layer does not have
    met = []
    for name in residuals:
        layer.get_submodule(name).register_forward_pre_hook(lambda module, args, name=name: met.append(name))
    x, tokens = torch.randn(2, 3, 32), torch.full((2, 3), 5)
    layer(x, tokens) if layer_cls is EncoderLayer else layer(x, x, tokens)
    assert met == [sublayer.residual for sublayer in declared]
