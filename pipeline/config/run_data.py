"""A run's data: the corpus its config names (prepared, sharded or the synthetic task), and the config with the
vocabulary sizes that data gives: what every entry point that trains, plans or compares starts from."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fathom.common.errors import ConfigError
from fathom.corpus.batches import ParallelCorpus, SyntheticTranslation
from fathom.corpus.dataset import BinarizedCorpus, PreparedData, ShardedCorpus
from fathom.model.model_config import ModelConfig
from fathom.pipeline.config.run_config import RunConfig, load_config


def build_corpus(cfg: RunConfig, split: str = "train", checksums: bool = True) -> ParallelCorpus:
    """The split of the run's data; `checksums`: verify its files' checksums, not only their sizes."""
    if cfg.data.directory is None:
        return SyntheticTranslation(cfg.data.synthetic, split)
    cfg.data.check_prepared()
    if split == "train" and len(cfg.data.shards) > 1:
        return ShardedCorpus(cfg.data.shards, split, checksums)
    return BinarizedCorpus(cfg.data.directory, split, checksums)


def with_vocab(cfg: ModelConfig, corpus: ParallelCorpus) -> ModelConfig:
    for key, size in (("src_vocab_size", corpus.src_vocab_size), ("tgt_vocab_size", corpus.tgt_vocab_size)):
        if getattr(cfg, key) not in (None, size):
            raise ConfigError(f"model.{key}: {getattr(cfg, key)} but the data's dictionary has {size}; remove the key")
    # One table for both sides needs one dictionary: separate ones of equal size would pass the size
    # check and give a token id a different word on each side (fairseq refuses this too).
    if (
        cfg.share_all_embeddings
        and isinstance(corpus, PreparedData)
        and corpus.src_dict.symbols != corpus.tgt_dict.symbols
    ):
        raise ConfigError(
            "model.share_all_embeddings: the data has separate source and target dictionaries (prepared with "
            "--separate-vocab); prepare it without, or set share_all_embeddings false"
        )
    return replace(cfg, src_vocab_size=corpus.src_vocab_size, tgt_vocab_size=corpus.tgt_vocab_size)


def resolve_run(
    path: str | Path, overrides: list[str], world_size: int | None, checksums: bool = True
) -> tuple[RunConfig, ParallelCorpus]:
    """A run's config with the vocabulary sizes its training data gives, and that data: what every
    entry point that trains, plans or compares starts from."""
    cfg = load_config(path, overrides, world_size)
    corpus = build_corpus(cfg, checksums=checksums)
    cfg.model = with_vocab(cfg.model, corpus)
    return cfg, corpus
