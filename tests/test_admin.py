"""Admin: the profiling pass and omegas against the papers' formula, and saved profiles."""

import math

import pytest
import torch

from fathom.common.errors import ConfigError
from fathom.model.admin import (
    admin_residuals,
    apply_omegas,
    load_profile,
    omegas_from,
    profile,
    save_profile,
    sublayers,
)
from fathom.model.layers import key_mask
from fathom.model.transformer import Transformer
from tests.test_norms import config


def test_omegas_sum_the_variances_before_each_sublayer_per_stack():
    cfg = config("admin", encoder_layers=2, decoder_layers=1)
    enc, dec = sublayers(cfg).values()
    # (Var[input], Var[branch]); only the first sublayer's input, the embedding x_0, enters the sum.
    variances = {
        **dict(zip(enc, [(4.0, 1.0), (9.0, 2.0), (9.0, 3.0), (9.0, 5.0)], strict=True)),
        **dict(zip(dec, [(0.25, 0.75), (9.0, 1.0), (9.0, 7.0)], strict=True)),
    }
    omegas = omegas_from(variances, cfg)
    assert [omegas[n] for n in enc] == pytest.approx([1.0, math.sqrt(5), math.sqrt(7), math.sqrt(10)])
    assert [omegas[n] for n in dec] == pytest.approx([1.0, 1.0, math.sqrt(2)])
    with pytest.raises(ValueError, match="no variance recorded for decoder.layers.0.self_attn_residual"):
        omegas_from({n: variances[n] for n in enc}, cfg)


def test_profiling_pass_measures_each_branch_by_hand():
    """The first encoder layer's variances and the omegas that follow, computed from its submodules."""
    torch.manual_seed(0)
    cfg = config("admin", encoder_layers=2, decoder_layers=1)
    model = Transformer(cfg)
    src, prev = torch.randint(4, 30, (3, 7)), torch.randint(4, 30, (3, 6))
    src[0, 5:] = 1  # padding, which the variance counts like any position
    omegas = omegas_from(profile(model, src, prev), cfg)

    layer = model.encoder.layers[0]
    with torch.no_grad():
        x0 = model.encoder.embed_tokens.embed(src)
        f1 = layer.self_attn(x0, x0, key_mask(src))
        f2 = layer.fc2(torch.relu(layer.fc1(layer.self_attn_layer_norm(x0 + f1))))
    var = [float(t.double().var(unbiased=False)) for t in (x0, f1, f2)]
    assert omegas["encoder.layers.0.self_attn_residual"] == 1.0
    assert omegas["encoder.layers.0.ffn_residual"] == pytest.approx(math.sqrt(var[0] + var[1]), rel=1e-6)
    assert omegas["encoder.layers.1.self_attn_residual"] == pytest.approx(math.sqrt(sum(var)), rel=1e-6)
    assert model.training  # profiling ran without dropout and left the mode as it was


def test_admin_sublayer_follows_formula():
    torch.manual_seed(0)
    layer = Transformer(config("admin")).encoder.layers[0].eval()
    omega = torch.rand(32) + 0.5
    with torch.no_grad():
        layer.ffn_residual.omega.copy_(omega)
    h = torch.randn(2, 5, 32)
    branch = layer.fc2(torch.relu(layer.fc1(h)))
    torch.testing.assert_close(
        layer.ffn_residual(h, layer.ffn, layer.final_layer_norm), layer.final_layer_norm(h * omega + branch)
    )


def test_saved_profile_reloads_to_the_same_model(tmp_path):
    cfg = config("admin")
    torch.manual_seed(0)
    profiled = Transformer(cfg)
    src, prev = torch.randint(4, 30, (3, 7)), torch.randint(4, 30, (3, 6))
    variances = profile(profiled, src, prev)
    omegas = omegas_from(variances, cfg)
    apply_omegas(admin_residuals(profiled), omegas)
    save_profile(tmp_path / "admin_profile.json", variances, omegas)

    torch.manual_seed(0)
    reloaded = Transformer(cfg)
    apply_omegas(admin_residuals(reloaded), load_profile(tmp_path / "admin_profile.json", cfg))
    for (name, a), b in zip(profiled.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert len({float(m.omega.detach()[0]) for m in admin_residuals(reloaded).values()}) > 2


def test_unusable_profiles_are_one_line_errors(tmp_path):
    cfg = config("admin")
    with pytest.raises(ConfigError, match=r"model.admin.profile: .*nothing.json does not exist"):
        load_profile(tmp_path / "nothing.json", cfg)
    omegas = omegas_from(profile(Transformer(cfg), torch.randint(4, 30, (2, 5)), torch.randint(4, 30, (2, 4))), cfg)
    save_profile(tmp_path / "p.json", {}, omegas)
    with pytest.raises(ConfigError, match=r"profiles 12 sublayers, this model has 15 \(3L-3L\); profile again"):
        load_profile(tmp_path / "p.json", config("admin", decoder_layers=3))


def test_profiling_with_dropout_as_the_authors_code_gives_larger_omegas():
    """model.admin.profile_dropout: dropout scales the surviving activations up, so every branch's
    variance, and every omega after the first of a stack, grows; the model's mode is left as it was."""
    torch.manual_seed(0)
    cfg = config("admin", encoder_layers=4, decoder_layers=4, dropout=0.3)
    model = Transformer(cfg).eval()
    src, prev = torch.randint(4, 30, (8, 9)), torch.randint(4, 30, (8, 8))
    without_dropout = omegas_from(profile(model, src, prev), cfg)
    assert omegas_from(profile(model, src, prev), cfg) == without_dropout  # no dropout: no randomness
    with_dropout = omegas_from(profile(model, src, prev, dropout=True), cfg)
    ratios = [with_dropout[name] / without_dropout[name] for name in without_dropout if without_dropout[name] != 1.0]
    assert len(ratios) == 2 * 4 - 1 + 3 * 4 - 1 and min(ratios) > 1.0
    assert not model.training and not any(m.training for m in model.modules())
