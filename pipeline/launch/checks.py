"""Everything a run is checked for before any process group exists: scripts/train.py runs it on every
rank, and scripts/launch.py before it launches anything. Each failure is a ConfigError, one line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fathom.common.bleu import bleu_metric
from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError
from fathom.common.outputs import check_makeable
from fathom.common.run_layout import META_FILE, has_checkpoints
from fathom.corpus.batches import ParallelCorpus, check_budget
from fathom.corpus.dataset import PreparedData, check_vocab
from fathom.model.layers import compiler_missing
from fathom.model.model_config import ModelConfig
from fathom.model.trained import check_init_from
from fathom.pipeline.checkpoint import saving
from fathom.pipeline.checkpoint.run_directory import check_not_in_use
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.config.run_data import build_corpus, resolve_run
from fathom.pipeline.engine import admin_profile
from fathom.pipeline.engine.cuda_graphs import check_cuda_graphs
from fathom.pipeline.parts.auto_checkpointing import resolve_checkpointing
from fathom.pipeline.parts.specs import check_partition_layers
from fathom.pipeline.world.distributed import launched_world


def check_fits(corpus: ParallelCorpus, cfg: RunConfig) -> None:
    """Every training pair fits a micro-batch's token budget and the model's positions."""
    lengths = corpus.lengths()
    check_budget(lengths, cfg.batch_size)
    if lengths.max() > cfg.model.max_positions:
        raise ConfigError(
            f"model.max_positions: {cfg.model.max_positions} is below the longest training pair ({lengths.max()} "
            "tokens); raise it, or prepare the data with a smaller --max-len"
        )


def check_valid_positions(valid: ParallelCorpus, model: ModelConfig) -> None:
    """Validation pairs longer than model.max_positions, which no training pair is (check_fits). A learned
    position table has no row for them: validation would fail after train.valid_interval steps, so they
    are refused. Sinusoids reach any position, so they are evaluated, at positions training never saw,
    and a few such pairs can dominate the validation loss: the first rank says how many (fairseq refuses
    them unless --skip-invalid-size-inputs-valid-test leaves them out)."""
    lengths = valid.lengths()
    over = int((lengths > model.max_positions).sum())
    if not over:
        return
    what = (
        f"{over} of {len(lengths)} validation pairs are longer than model.max_positions {model.max_positions} "
        f"(the longest {lengths.max()} tokens)"
    )
    fix = "remove them from the raw valid split and prepare the data again"
    if model.learned_pos:
        raise ConfigError(f"model.max_positions: {what}, past the learned position table; {fix}")
    if launched_world().rank == 0:
        print(
            f"fathom: warning: {what}: validation evaluates them at positions no training pair reaches, and they "
            f"weigh on the validation loss; {fix}",
            file=sys.stderr,
            flush=True,
        )


def check_run(args: argparse.Namespace, world_size: int, checksums: bool = True) -> tuple[RunConfig, ParallelCorpus]:
    """Everything a run is checked for before any process group exists (scripts/launch.py runs it
    before launching); raises ConfigError. `checksums`: verify the data's checksums, not only sizes."""
    cfg, corpus = resolve_run(args.config, args.override, world_size, checksums)
    if cfg.train.compile and (missing := compiler_missing()):
        raise ConfigError(f"train.compile: torch.compile cannot build kernels here: {missing}; or set it false")
    check_partition_layers(cfg)
    check_cuda_graphs(cfg)
    admin_profile.check(cfg.model)
    check_fits(corpus, cfg)
    cfg = resolve_checkpointing(cfg, corpus, world_size)  # "auto": an interval, for pairs known to fit
    if cfg.train.valid_bleu is not None:  # its tokenizer's extra is there, rather than refused at step N
        bleu_metric(getattr(corpus, "tgt", None))
    if cfg.train.valid_interval > 0:
        valid = build_corpus(cfg, "valid", checksums)
        if len(valid) == 0:
            raise ConfigError(
                "train.valid_interval: the validation set is empty; give it sentences or set 0 (no validation)"
            )
        check_valid_positions(valid, cfg.model)
    save_dir = Path(cfg.train.save_dir)
    check_makeable(save_dir, "train.save_dir")
    if (save_dir / META_FILE).exists():
        raise ConfigError(f"train.save_dir: {save_dir} is a prepared data directory; choose another for checkpoints")
    check_not_in_use(save_dir)
    if cfg.train.init_from:
        check_init_from(cfg.train.init_from, cfg.model)
        if isinstance(corpus, PreparedData):  # a run's dictionaries are its data's; an import keeps copies
            source = cfg.train.init_from
            check_vocab(source, cfg.model, corpus, "prepare it with those dictionaries: scripts/prepare_data.py "
                        f"--vocab-from that directory, or for an import --spm-model MODEL --dict {source}/dict.SRC.txt "
                        f"{source}/dict.TGT.txt (docs/REAL_DATA.md)")  # fmt: skip
    if not args.resume and has_checkpoints(save_dir):
        raise ConfigError(
            f"train.save_dir: {save_dir} already holds checkpoints; pass --resume to continue them "
            "or choose another save_dir"
        )
    if args.resume:
        saving.check_resume(save_dir, cfg, corpus, world_size)
    return cfg, corpus


def parse_train_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The training command's flags (scripts/train.py), which every rank and scripts/launch.py read."""
    parser = command_parser(description)
    parser.add_argument("--config", required=True, help="experiment JSON (DeepSpeed keys + model/data/train)")
    parser.add_argument(
        "--override", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help="e.g. model.encoder_layers=24"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.save_dir")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    return parser.parse_args(argv)
