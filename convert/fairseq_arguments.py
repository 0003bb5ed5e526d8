"""The model section as fairseq's transformer arguments, written once: the export writes them
(convert/to_fairseq.py), the import reads them back (convert/from_fairseq.py), and torchscale, whose
config takes fairseq's names, is built from them (tools/torchscale_peer.py). Every ModelConfig field is
either an argument here or says in NOT_ARGUMENTS how the conversions carry it; tests/test_fairseq.py fails
on a field that is neither, which would otherwise export silently wrong."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fathom.common.errors import ConfigError
from fathom.model.model_config import ModelConfig

# ModelConfig field -> fairseq's argument(s) for it (the encoder's and the decoder's, which must agree)
ARGUMENTS: dict[str, tuple[str, ...]] = {
    "encoder_layers": ("encoder_layers",),
    "decoder_layers": ("decoder_layers",),
    "embed_dim": ("encoder_embed_dim", "decoder_embed_dim"),
    "ffn_dim": ("encoder_ffn_embed_dim", "decoder_ffn_embed_dim"),
    "attention_heads": ("encoder_attention_heads", "decoder_attention_heads"),
    "dropout": ("dropout",),
    "attention_dropout": ("attention_dropout",),
    "activation_dropout": ("activation_dropout",),
    "max_positions": ("max_source_positions", "max_target_positions"),
    "learned_pos": ("encoder_learned_pos", "decoder_learned_pos"),
    "share_all_embeddings": ("share_all_embeddings",),
}
# fairseq's base_architecture values, for a checkpoint's arguments that leave one out
BASE_ARCHITECTURE = {"encoder_layers": 6, "decoder_layers": 6, "embed_dim": 512, "ffn_dim": 2048,
                     "attention_heads": 8, "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
                     "max_positions": 1024, "learned_pos": False, "share_all_embeddings": False}  # fmt: skip
# the fields that are no argument of their own, and how the conversions carry them
NOT_ARGUMENTS = {
    "share_decoder_input_output_embed": "fairseq's flag of the same name, also set under share_all_embeddings",
    "norm_scheme": "encoder_/decoder_normalize_before: Pre-LN or Post-LN; the other schemes fold into the weights",
    "schemes": "the schemes' options, folded into the weights (model/fold.py)",
    "src_vocab_size": "the source dictionary's size: the embedding table's rows",
    "tgt_vocab_size": "the target dictionary's size: the embedding table's rows",
}


def unmapped_fields() -> list[str]:
    """ModelConfig's fields neither an argument nor carried otherwise: none, or a conversion is incomplete."""
    return [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ARGUMENTS | NOT_ARGUMENTS]


def fairseq_arguments(cfg: ModelConfig) -> dict[str, Any]:
    """{fairseq argument: value} of every ModelConfig field that is one."""
    return {name: getattr(cfg, field) for field, names in ARGUMENTS.items() for name in names}


def read_arguments(args: dict[str, Any], path: Path) -> dict[str, Any]:
    """{ModelConfig field: value} from fairseq's arguments `args` (base_architecture's where one is left out);
    the encoder's and decoder's must agree, but for the longest positions, of which the run takes the shorter."""
    fields = {}
    for field, names in ARGUMENTS.items():
        values = [BASE_ARCHITECTURE[field] if args.get(name) is None else args[name] for name in names]
        if field == "max_positions":
            values = [min(values)]
        if len(set(values)) > 1:
            sides = " but ".join(f"{name}={value}" for name, value in zip(names, values, strict=True))
            raise ConfigError(f"{path}: {sides}; both sides must agree")
        fields[field] = values[0]
    return fields
