"""Numerical parity with torchscale's EncoderDecoder (pip torchscale 0.3.0): with the same weights,
each scheme torchscale has (Post-LN, Pre-LN, DeepNorm, Sub-LN) computes torchscale's logits."""

import re

import pytest
import torch

from fathom.model import ModelConfig, Transformer
from fathom.tools.torchscale_peer import TORCHSCALE_SCHEMES, load_our_weights, torchscale_model, torchscale_name
from fathom.tools.training_comparison import main as compare_main
from tests.helpers import ROOT

VOCAB, DIM, MAX_POSITIONS = 40, 32, 16


def torchscale(cfg: ModelConfig) -> torch.nn.Module:
    try:
        return torchscale_model(cfg, MAX_POSITIONS)
    except ImportError as err:
        pytest.skip(f"torchscale is not importable ({err}); `make peers` installs it")


@pytest.mark.parametrize("scheme", sorted(TORCHSCALE_SCHEMES))
@pytest.mark.parametrize("n, m", [(3, 2), (6, 6)])
def test_same_weights_give_torchscales_outputs(scheme, n, m):
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
    theirs = torchscale(cfg).eval()
    load_our_weights(theirs, ours)  # raises on a weight either side lacks, but torchscale's position tables

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
    torch.manual_seed(0)
    n, m, dim = 6, 4, 256
    cfg = ModelConfig(
        encoder_layers=n, decoder_layers=m, embed_dim=dim, ffn_dim=2 * dim, attention_heads=4,
        share_all_embeddings=True, norm_scheme=scheme, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
        schemes={"deepnorm": {"init": "torchscale"}},
    )  # fmt: skip
    ours = dict(Transformer(cfg).named_parameters())
    theirs = dict(torchscale(cfg).named_parameters())
    checked = 0
    for name, param in ours.items():
        if "embed" not in name:
            # a bias has only 256 or 512 draws: its std is known to about 6%
            rel = 0.05 if param.dim() == 2 else 0.2
            assert param.std().item() == pytest.approx(theirs[torchscale_name(name)].std().item(), rel=rel), name
            checked += 1
    assert checked == len(theirs) - 3  # all but the shared token embedding and the two position tables


@pytest.mark.slow
def test_compare_training_measures_both_models(multi30k_slice, capsys):
    """scripts/compare_training.py: each model's validation loss with real and shuffled sources and
    its encoder spread at the requested steps."""
    torchscale(ModelConfig(encoder_layers=1, decoder_layers=1, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB))
    small = [f"data.path={multi30k_slice}", "model.encoder_layers=2", "model.decoder_layers=2", "model.embed_dim=32",
             "model.ffn_dim=64", "model.norm_scheme=deepnorm"]  # fmt: skip
    compare_main(["--config", str(ROOT / "ds_configs" / "default.json"), "--override", *small, "--at", "1", "2"])
    lines = capsys.readouterr().out.splitlines()
    for name in ("fathom", "torchscale"):
        measured = [line for line in lines if line.startswith(name) and "valid nll" in line]
        assert [line.split()[2] for line in measured] == ["1", "2"], lines
        assert all("shuffled sources" in line and "encoder spread" in line for line in measured)


def test_compare_training_refuses_a_scheme_torchscale_lacks(capsys, multi30k_slice):
    with pytest.raises(SystemExit) as exc:
        compare_main(["--config", str(ROOT / "ds_configs" / "study_multi30k_base.json"), "--override",
                      f"data.path={multi30k_slice}", "model.norm_scheme=branchnorm", "--at", "1"])  # fmt: skip
    assert exc.value.code == 2 and "torchscale has no branchnorm" in capsys.readouterr().err


SAME_WEIGHTS = ["model.encoder_layers=3", "model.decoder_layers=3", "model.norm_scheme=deepnorm", "train.max_steps=4"]


def test_same_weights_train_in_lockstep_with_torchscale(multi30k_slice, capsys):
    """The depth study's control for fathom itself: from one set of weights, on the same micro-batches, fathom's
    DeepNorm and torchscale's DeepNet give the same loss at step 1 and stay within float rounding after."""
    torchscale(ModelConfig(encoder_layers=1, decoder_layers=1, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB))
    compare_main(["--config", str(ROOT / "ds_configs" / "study_multi30k_papers_base.json"), "--same-weights",
                  "--override", f"data.path={multi30k_slice}", *SAME_WEIGHTS, "model.dropout=0", "--at", "1", "4",
                  "--tolerance", "1e-5"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step")]
    assert [line.split()[1] for line in steps] == ["1", "4"], lines
    first = re.search(r"loss fathom (\S+)  torchscale (\S+)", steps[0])
    assert first and abs(float(first[1]) - float(first[2])) <= 1e-5 * float(first[1])
    assert re.fullmatch(r"same weights, same micro-batches, 4 updates: relative loss difference \S+ at step 1, at "
                        r"most \S+ \(step \d\), within the tolerance 1e-05", lines[-1]), lines  # fmt: skip


def test_same_weights_refuse_dropout(multi30k_slice, capsys):
    """Each implementation draws its own dropout masks, so the losses would part for that alone."""
    with pytest.raises(SystemExit) as exc:
        compare_main(["--config", str(ROOT / "ds_configs" / "study_multi30k_papers_base.json"), "--same-weights",
                      "--override", f"data.path={multi30k_slice}", *SAME_WEIGHTS, "--at", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "model.dropout: 0.1; --same-weights compares without dropout" in err, err
