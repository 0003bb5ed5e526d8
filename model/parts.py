"""The model's parts, written down once: their fairseq names, classes, arguments and shared tables.

Everything that builds or names the model derives from `model_parts`: the single-process
Transformer (model/transformer.py), the pipeline's stage modules and LayerSpecs
(pipeline/parts/stage_modules.py, pipeline/parts/specs.py), the names of a checkpoint's layer files, export and
the memory planner. Every class here is a plain PyTorch module and nothing here imports DeepSpeed:
the tuple-in, tuple-out forms its PipelineModule runs are pipeline/parts/stage_modules.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from fathom.model.embedding import Embedding
from fathom.model.layers import DecoderLayer, EncoderLayer
from fathom.model.model_config import ModelConfig
from fathom.model.norms import build_scheme


@dataclass(frozen=True)
class Part:
    """One module of the model, under its fairseq name (encoder.layers.3, decoder.output_projection)."""

    name: str
    module_class: type[nn.Module]  # in the single-process model
    args: tuple[Any, ...]
    # Parts with one `tie` share one module, built and saved by the first of them; the later uses are
    # `reused`.
    tie: str | None = None
    reused: bool = False

    @property
    def saved(self) -> bool:
        """Whether a checkpoint has a layer file for this part (a shared table: its first use only)."""
        return not self.reused

    def build(self) -> nn.Module:
        return self.module_class(*self.args)


def reuse(first: Part, name: str) -> Part:
    """A later use of `first`'s table under another name."""
    return dataclasses.replace(first, name=name, reused=True)


def model_parts(cfg: ModelConfig) -> list[Part]:
    """Every part of the model in forward order: the pipeline's layer list."""
    scheme, dim = build_scheme(cfg), cfg.embed_dim
    positions = cfg.max_positions if cfg.learned_pos else 0
    src = (cfg.src_vocab_size, dim, cfg.dropout, scheme.embedding_scale("encoder"), positions)
    tgt = (cfg.tgt_vocab_size, dim, cfg.dropout, scheme.embedding_scale("decoder"), positions)
    encoder_embed = Part("encoder.embed_tokens", Embedding, src)
    decoder_embed = Part("decoder.embed_tokens", Embedding, tgt)
    output = Part("decoder.output_projection", Embedding, (cfg.tgt_vocab_size, dim))
    # the tie keys name DeepSpeed's tied modules in checkpoints: they stay as they are
    if cfg.share_all_embeddings:
        encoder_embed = dataclasses.replace(encoder_embed, tie="embed")
        decoder_embed = reuse(encoder_embed, decoder_embed.name)
        output = reuse(encoder_embed, output.name)
    elif cfg.share_decoder_input_output_embed:
        decoder_embed = dataclasses.replace(decoder_embed, tie="decoder_embed")
        output = reuse(decoder_embed, output.name)

    final_norms = scheme.normalize_before
    return [
        encoder_embed,
        *(Part(f"encoder.layers.{i}", EncoderLayer, (cfg, scheme)) for i in range(cfg.encoder_layers)),
        *([Part("encoder.layer_norm", nn.LayerNorm, (dim,))] if final_norms else []),
        decoder_embed,
        *(Part(f"decoder.layers.{i}", DecoderLayer, (cfg, scheme)) for i in range(cfg.decoder_layers)),
        *([Part("decoder.layer_norm", nn.LayerNorm, (dim,))] if final_norms else []),
        output,
    ]


def build_parts(parts: Iterable[Part]) -> Iterator[nn.Module]:
    """A module for each part (`part.build()`: its module class here, its pipe class for a
    pipeline/stage_modules.PipePart), a shared table's uses sharing one, built one at a time as the
    caller asks for it (export streams a deep model); modules are in training mode."""
    tables: dict[str, nn.Module] = {}
    for part in parts:
        if part.reused:
            yield tables[part.tie]
            continue
        module = part.build()
        if part.tie is not None:
            tables[part.tie] = module
        yield module


def module_names(cfg: ModelConfig) -> list[str]:
    """The model's parts in forward order, by their fairseq names (tied tables under every alias)."""
    return [part.name for part in model_parts(cfg)]


def fairseq_key(part: str, key: str) -> str:
    """A part's parameter under fairseq's name: the part's, but learned positions, which fairseq keeps
    beside the token table (`encoder.embed_positions`) and this model inside it."""
    if key == "positions.weight":
        return f"{part.split('.')[0]}.embed_positions.weight"
    return f"{part}.{key}"


def saved_names(cfg: ModelConfig) -> list[str | None]:
    """module_names(cfg), with None for every later use of a shared table: a pipeline checkpoint has a
    file per layer index, and DeepSpeed saves a tied layer under its first use only."""
    return [part.name if part.saved else None for part in model_parts(cfg)]
