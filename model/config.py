"""Typed configuration sections with strict, user-facing validation.

DeepSpeed silently ignores keys it does not know, so every section of ours is checked here: an
unknown key or a value of the wrong type is a one-line `ConfigError` naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from common.errors import ConfigError, unknown_key_error

# fairseq's dictionary puts these four symbols first; exported models rely on the same ids.
BOS, PAD, EOS, UNK = 0, 1, 2, 3
NUM_SPECIAL = 4


T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_value(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(value, option, key)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if origin is typing.Literal:  # a choice: the type names every allowed value
        choices = typing.get_args(tp)
        if not any(value == choice and type(value) is type(choice) for choice in choices):
            raise ConfigError(f"{key}: {value!r}; choose one of {', '.join(map(str, choices))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object, got {value!r}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_check_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return parse_section(tp, value, key)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return value


def parse_section(cls: type[T], data: Any, where: str) -> T:
    """Builds dataclass `cls` from a JSON object, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise unknown_key_error(f"{where}.{key}", names)
    values = {key: _check_value(value, hints[key], f"{where}.{key}") for key, value in data.items()}
    return cls(**values)


@dataclass
class ModelConfig:
    """Architecture; defaults are fairseq's `transformer` (base) with Post-LN."""

    encoder_layers: int = 6
    decoder_layers: int = 6
    embed_dim: int = 512
    ffn_dim: int = 2048
    attention_heads: int = 8
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    max_positions: int = 1024
    # fairseq's --encoder-learned-pos/--decoder-learned-pos (both): trained position tables.
    learned_pos: bool = False
    share_all_embeddings: bool = False
    share_decoder_input_output_embed: bool = False
    norm_scheme: str = "post_ln"
    # Options of each scheme, keyed by registry name; users write them as model.<scheme>.<option>.
    schemes: dict[str, dict] = field(default_factory=dict)
    # Filled from the data's dictionaries when left out.
    src_vocab_size: int | None = None
    tgt_vocab_size: int | None = None

    def __post_init__(self) -> None:
        for key in ("encoder_layers", "decoder_layers", "embed_dim", "ffn_dim", "attention_heads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}: must be at least 1, got {getattr(self, key)}")
        if self.max_positions < 2:  # a token and its eos
            raise ConfigError(f"model.max_positions: must be at least 2, got {self.max_positions}")
        if self.embed_dim % self.attention_heads:
            raise ConfigError(
                f"model.embed_dim: {self.embed_dim} is not divisible by model.attention_heads "
                f"{self.attention_heads}; pick a multiple"
            )
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"model.{key}: must be in [0, 1), got {getattr(self, key)}")
        if self.learned_pos and self.share_all_embeddings:
            raise ConfigError(
                "model.learned_pos: with share_all_embeddings the encoder and decoder would share one position "
                "table (fairseq keeps two); set one of them false"
            )
        if self.share_all_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ConfigError(
                "model.share_all_embeddings: source and target vocabularies differ "
                f"({self.src_vocab_size} vs {self.tgt_vocab_size}); use a joint vocabulary or set it false"
            )
