"""torchscale's EncoderDecoder (pip torchscale 0.3.0), the peer implementation fathom is checked against
(tests/test_torchscale.py: same weights, same logits) and timed against (scripts/bench.py)."""

from __future__ import annotations

import re
import sys
import types

import torch
from torch import nn

from fathom.common.errors import ConfigError
from fathom.convert.fairseq_arguments import fairseq_arguments
from fathom.model.embedding import sinusoidal_table
from fathom.model.model_config import PAD, ModelConfig

# Our schemes that torchscale implements, as its config flags. torchscale's default is Sub-LN, so
# Post-LN and Pre-LN must turn subln off; deepnorm=True turns it off by itself.
TORCHSCALE_SCHEMES = {
    "post_ln": {"subln": False, "encoder_normalize_before": False, "decoder_normalize_before": False},
    "pre_ln": {"subln": False},
    "deepnorm": {"deepnorm": True},
    "sub_ln": {"subln": True},
}


def _drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    assert drop_prob == 0.0, "torchscale models here use drop_path_rate 0"
    return x


def import_torchscale() -> types.SimpleNamespace:
    """torchscale's classes; ImportError if it is not installed.

    torchscale imports timm for drop_path alone, unused at drop_path_rate 0, and timm would pull
    torchvision and with it a CUDA torch; so `make peers` installs torchscale without dependencies
    and, when timm is absent, this stands in for that one function."""
    try:
        import timm.models.layers  # noqa: F401
    except ImportError:
        layers = types.ModuleType("timm.models.layers")
        layers.drop_path = _drop_path
        sys.modules.update({"timm": types.ModuleType("timm"), "timm.models": types.ModuleType("timm.models")})
        sys.modules["timm.models.layers"] = layers
    from torchscale.architecture.config import EncoderDecoderConfig
    from torchscale.architecture.encoder_decoder import EncoderDecoder
    from torchscale.component.embedding import PositionalEmbedding, TextEmbedding

    return types.SimpleNamespace(
        Config=EncoderDecoderConfig, Model=EncoderDecoder, Positions=PositionalEmbedding, Text=TextEmbedding
    )


def torchscale_model(cfg: ModelConfig, max_positions: int) -> nn.Module:
    """torchscale's EncoderDecoder with our config's depth, width, vocabularies, dropout, embedding
    sharing and scheme; its forward(src_tokens, prev_output_tokens) returns (logits, extras).

    Positions are fairseq's sinusoids (ours) as a frozen table of `max_positions` rows; torchscale
    numbers positions from 2, so a sequence may be up to max_positions - 2 long."""
    if cfg.norm_scheme not in TORCHSCALE_SCHEMES:
        raise ConfigError(
            f"model.norm_scheme: torchscale has no {cfg.norm_scheme}; choose one of {', '.join(TORCHSCALE_SCHEMES)}"
        )
    if cfg.src_vocab_size != cfg.tgt_vocab_size:  # torchscale's config has one vocab_size
        raise ConfigError("model.src_vocab_size: torchscale needs equal source and target vocabularies")
    ts = import_torchscale()
    dim = cfg.embed_dim
    # torchscale's config takes fairseq's argument names; the positions it gets from us (below)
    shape = {name: value for name, value in fairseq_arguments(cfg).items() if "positions" not in name
             and not name.endswith("learned_pos")}  # fmt: skip
    args = ts.Config(
        **shape, **TORCHSCALE_SCHEMES[cfg.norm_scheme], activation_fn="relu", no_scale_embedding=False,
        vocab_size=cfg.tgt_vocab_size, share_decoder_input_output_embed=cfg.share_decoder_input_output_embed,
    )  # fmt: skip

    def positions() -> nn.Module:
        table = ts.Positions(max_positions, dim)
        table.weight.data.copy_(sinusoidal_table(max_positions, dim))
        return table.requires_grad_(False)

    src_embed = ts.Text(cfg.src_vocab_size, dim, padding_idx=PAD)
    # With share_all_embeddings torchscale's decoder takes the encoder's table when given none.
    tgt_embed = None if cfg.share_all_embeddings else ts.Text(cfg.tgt_vocab_size, dim, padding_idx=PAD)
    return ts.Model(args, src_embed, positions(), tgt_embed, positions())


def torchscale_name(name: str) -> str:
    """Our parameter names are fairseq's; torchscale groups the FFN under `ffn.`."""
    return re.sub(r"(layers\.\d+\.)(fc1|fc2|ffn_layernorm)", r"\1ffn.\2", name)


def load_our_weights(theirs: nn.Module, ours: nn.Module) -> None:
    """torchscale's model with our model's weights, name for name (its position tables are its own)."""
    missing, unexpected = theirs.load_state_dict({torchscale_name(k): v for k, v in ours.state_dict().items()},
                                                 strict=False)  # fmt: skip
    if unexpected or any("embed_positions" not in name for name in missing):
        raise ValueError(f"torchscale's model does not take our weights: missing {missing}, unexpected {unexpected}")
