"""Validation during training: the loss on the validation split, with train.valid_bleu its BLEU decoded
through the stages (pipeline/decode.py), and the best value so far, which picks the `best` checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from common.checkpoint_format import BEST_VALUE, model_states
from common.heap import heap_for_decoding
from common.run_layout import TRANSLATIONS, linked_best
from corpus.batches import MicroBatch, eval_batches
from pipeline.config.run_config import RunConfig, build_corpus
from pipeline.decode import bleu_set, valid_bleu
from pipeline.safety.watchdog import Watchdog


def validate(engine: deepspeed.DeepSpeedEngine, batches: list[MicroBatch]) -> float:
    """Mean loss over the validation micro-batches, each data-parallel replica taking a share."""
    grid = engine.grid
    mine = batches[grid.get_data_parallel_rank() :: grid.get_data_parallel_world_size()]
    loss = engine.eval_batch(iter(mine), num_micro_batches=len(mine)) if mine else torch.tensor(0.0)
    total = torch.tensor([loss.item() * len(mine), float(len(mine))], device=engine.device)
    dist.all_reduce(total, group=grid.get_data_parallel_group())
    return (total[0] / total[1]).item()


class Best:
    """The best validation value so far by train.best_metric (the lowest loss or the highest BLEU), kept
    in every checkpoint's client state. A run starts from the value of the `best` checkpoint it has on
    disk, not the one in the checkpoint it resumes: one older than `best` (a `latest` moved back by
    hand, or a crash) would otherwise let a worse model replace the better one."""

    def __init__(self, metric: str, save_dir: Path):
        self.metric, self.key = metric, BEST_VALUE.format(metric=metric)
        self.sign = 1.0 if metric == "loss" else -1.0  # lower is better for a loss
        self.tag = linked_best(save_dir)
        saved = None if self.tag is None else model_states(save_dir / self.tag)
        self.value = (saved or {}).get(self.key, self.sign * float("inf"))

    def update(self, value: float) -> bool:
        """Whether `value` is the new best."""
        if self.sign * value < self.sign * self.value:
            self.value = value
            return True
        return False

    def state(self) -> dict[str, float]:
        return {self.key: self.value}


class Validation:
    """The model's validation loss after a step, and with train.valid_bleu its BLEU on the validation
    set, decoded through the stages; the translations go to SAVE_DIR/translations/valid-stepN.txt."""

    def __init__(self, engine: deepspeed.PipelineEngine, cfg: RunConfig, watchdog: Watchdog):
        self.engine, self.cfg, self.watchdog = engine, cfg, watchdog
        corpus = build_corpus(cfg, "valid")
        self.batches = eval_batches(corpus, cfg.batch_size)
        bleu = cfg.train.valid_bleu
        self.bleu_set = bleu_set(corpus, bleu.sentences) if bleu else None

    def __call__(self, step: int) -> dict[str, Any]:
        self.watchdog.progress(f"validation after step {step}")
        record = {"step": step, "valid_loss": validate(self.engine, self.batches)}
        if self.bleu_set is not None:
            self.watchdog.progress(f"validation BLEU after step {step}")
            output = Path(self.cfg.train.save_dir) / TRANSLATIONS / f"valid-step{step}.txt"
            with heap_for_decoding():
                bleu, seconds = valid_bleu(
                    self.engine, self.cfg.model, self.bleu_set, self.cfg.train.valid_bleu, output
                )
            record.update(valid_bleu=bleu, valid_bleu_seconds=seconds)
        return record


def validation_line(record: dict[str, Any], best: Best) -> str:
    bleu = (
        f" | valid bleu {record['valid_bleu']:.2f} ({record['valid_bleu_seconds']:.1f} s)"
        if "valid_bleu" in record
        else ""
    )
    return f"step {record['step']} | valid loss {record['valid_loss']:.4f}{bleu} | best {best.metric} {best.value:.4f}"
