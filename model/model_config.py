"""The model's architecture section (`model` in a run's config), the dictionary's special ids and the
dtypes its weights are held in, by DeepSpeed's precision names."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fathom.common.errors import ConfigError
from fathom.common.sections import APPLIED, WEIGHTS, bounds

# fairseq's dictionary puts these four symbols first, in this order; exported models rely on the same ids.
SPECIAL_SYMBOLS = ("<s>", "<pad>", "</s>", "<unk>")
BOS, PAD, EOS, UNK = range(len(SPECIAL_SYMBOLS))
NUM_SPECIAL = len(SPECIAL_SYMBOLS)

VOCAB = f" ({NUM_SPECIAL} special symbols and a word)"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ModelConfig:
    """Architecture; defaults are fairseq's `transformer` (base) with Post-LN. What a resume does with a
    changed key (common.sections.OnResume): the weights' shapes follow most of them."""

    encoder_layers: int = field(default=6, metadata=WEIGHTS | bounds(1))
    decoder_layers: int = field(default=6, metadata=WEIGHTS | bounds(1))
    embed_dim: int = field(default=512, metadata=WEIGHTS | bounds(1))
    ffn_dim: int = field(default=2048, metadata=WEIGHTS | bounds(1))
    attention_heads: int = field(default=8, metadata=WEIGHTS | bounds(1))
    dropout: float = field(default=0.1, metadata=APPLIED | bounds(0, below=1))
    attention_dropout: float = field(default=0.0, metadata=APPLIED | bounds(0, below=1))
    activation_dropout: float = field(default=0.0, metadata=APPLIED | bounds(0, below=1))
    max_positions: int = field(default=1024, metadata=APPLIED | bounds(2, what=" (a token and its eos)"))
    # fairseq's --encoder-learned-pos/--decoder-learned-pos (both): trained position tables.
    learned_pos: bool = field(default=False, metadata=WEIGHTS)
    share_all_embeddings: bool = field(default=False, metadata=WEIGHTS)
    share_decoder_input_output_embed: bool = field(default=False, metadata=WEIGHTS)
    norm_scheme: str = field(default="post_ln", metadata=WEIGHTS)
    # Options of each scheme, keyed by registry name; users write them as model.<scheme>.<option>. Each
    # scheme's Options declares what a resume does with each of its options (model.model_section.scheme_option_rules).
    schemes: dict[str, dict] = field(default_factory=dict)
    # Filled from the data's dictionaries when left out.
    src_vocab_size: int | None = field(default=None, metadata=WEIGHTS | bounds(NUM_SPECIAL + 1, what=VOCAB))
    tgt_vocab_size: int | None = field(default=None, metadata=WEIGHTS | bounds(NUM_SPECIAL + 1, what=VOCAB))

    def __post_init__(self) -> None:
        if self.embed_dim % self.attention_heads:
            raise ConfigError(
                f"model.embed_dim: {self.embed_dim} is not divisible by model.attention_heads "
                f"{self.attention_heads}; pick a multiple"
            )
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
