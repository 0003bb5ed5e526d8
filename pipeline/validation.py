"""Validation during training: the loss on the validation split, with train.valid_bleu its BLEU decoded
through the stages (pipeline/decode.py), and the best value so far, which picks the `best` checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from fathom.common.checkpoint_format import BEST_VALUE, ClientState, model_states
from fathom.common.heap import heap_for_decoding
from fathom.common.run_layout import TRANSLATIONS, linked_best, translations_file
from fathom.corpus.batches import MicroBatch, eval_batches
from fathom.model.loss import token_losses
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.config.run_data import build_corpus
from fathom.pipeline.decode import bleu_set, valid_bleu
from fathom.pipeline.safety.watchdog import Watchdog


class LossSums:
    """The pipeline's loss function while it validates. It returns each micro-batch's training loss (its
    mean, which DeepSpeed's eval_batch and monitors read as ever) and keeps, for the validation loss, the
    micro-batch's sums over its target tokens: label-smoothed loss, nll, token count."""

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self.sums: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        smoothed, nll = token_losses(logits, target, self.smoothing)
        self.sums.append(torch.stack([smoothed.double().sum(), nll.double().sum(), nll.new_tensor(len(nll)).double()]))
        return smoothed.mean()

    def total(self, device: torch.device) -> torch.Tensor:
        """The sums over every micro-batch so far; zeros where none was scored (a stage before the last)."""
        return (
            torch.stack(self.sums).sum(0).to(device)
            if self.sums
            else torch.zeros(3, dtype=torch.float64, device=device)
        )


def validate(engine: deepspeed.DeepSpeedEngine, batches: list[MicroBatch], smoothing: float) -> dict[str, float]:
    """The validation loss as fairseq-validate computes it: summed over every target token of `batches`
    (eos included, pads not) and divided by their number, label-smoothed (`valid_loss`, fairseq's `loss`)
    and not (`valid_nll_loss`), in nats and in bits (fairseq prints bits). Each data-parallel replica
    scores every n-th micro-batch; the last stages' sums add up over the whole world. A replica left
    without a share (fewer micro-batches than replicas) still runs one, for nothing: eval_batch all-reduces
    its loss over the replicas, and the others would wait for it for ever."""
    grid = engine.grid
    mine = batches[grid.get_data_parallel_rank() :: grid.get_data_parallel_world_size()]
    run = mine or batches[:1]
    sums = LossSums(smoothing)
    training_loss, engine.module.loss_fn = engine.module.loss_fn, sums
    try:
        engine.eval_batch(iter(run), num_micro_batches=len(run), bcast_loss=False)
    finally:
        engine.module.loss_fn = training_loss
    if not mine:
        sums.sums.clear()  # the stand-in micro-batch is another replica's, counted there
    total = sums.total(engine.device)
    dist.all_reduce(total)
    smoothed, nll, tokens = total.tolist()
    nats = {"valid_loss": smoothed / tokens, "valid_nll_loss": nll / tokens}
    return {**nats, **{f"{key}_bits": value / math.log(2) for key, value in nats.items()}}


class Best:
    """The best validation value so far by train.best_metric (the lowest loss or the highest BLEU), kept
    in every checkpoint's client state. A run starts from the value of the `best` checkpoint it has on
    disk, not the one in the checkpoint it resumes: one older than `best` (a `latest` moved back by
    hand, or a crash) would otherwise let a worse model replace the better one."""

    def __init__(self, metric: str, save_dir: Path):
        self.metric = metric
        self.sign = 1.0 if metric == "loss" else -1.0  # lower is better for a loss
        self.tag = linked_best(save_dir)
        saved = ClientState.read((None if self.tag is None else model_states(save_dir / self.tag)) or {})
        self.value = saved.best.get(metric, self.sign * float("inf"))
        self.mean_of_means = metric == "loss" and metric in saved.best and not saved.loss_per_token

    def warning(self) -> str | None:
        """What a run resuming with a best loss from before losses were per target token must know."""
        if not self.mean_of_means:
            return None
        return (
            f"{self.tag}'s validation loss {self.value:.4f} is a mean of micro-batch means (fathom before "
            "validation losses were per target token), not comparable with this run's; the first validation "
            f"below it replaces {self.tag}"
        )

    def update(self, value: float) -> bool:
        """Whether `value` is the new best."""
        if self.sign * value < self.sign * self.value:
            self.value = value
            return True
        return False

    def state(self) -> dict[str, float]:
        """ClientState.best: the value by its metric."""
        return {self.metric: self.value}

    def record(self) -> dict[str, float]:
        """What metrics.jsonl keeps beside a validation: best_valid_METRIC, as a checkpoint names it."""
        return {BEST_VALUE.format(metric=self.metric): self.value}

    def text(self) -> str:
        """The value as the validation line prints it: a loss in nats with fairseq's bits beside it."""
        return loss_text(self.value) if self.metric == "loss" else f"{self.value:.4f}"


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
        record = {"step": step, **validate(self.engine, self.batches, self.cfg.train.label_smoothing)}
        if self.bleu_set is not None:
            self.watchdog.progress(f"validation BLEU after step {step}")
            output = Path(self.cfg.train.save_dir) / TRANSLATIONS / translations_file(step)
            with heap_for_decoding():
                bleu, seconds = valid_bleu(
                    self.engine, self.cfg.model, self.bleu_set, self.cfg.train.valid_bleu, output
                )
            record.update(valid_bleu=bleu, valid_bleu_seconds=seconds)
        return record


def loss_text(nats: float) -> str:
    """A loss as fathom prints it: nats, with the bits fairseq prints beside them."""
    return f"{nats:.4f} nats ({nats / math.log(2):.4f} bits)"


def validation_line(record: dict[str, Any], best: Best) -> str:
    """The losses in nats, fairseq's bits beside them: `loss` label-smoothed, `nll_loss` not."""
    losses = " | ".join(f"valid {name} {loss_text(record[f'valid_{name}'])}" for name in ("loss", "nll_loss"))
    bleu = (
        f" | valid bleu {record['valid_bleu']:.2f} ({record['valid_bleu_seconds']:.1f} s)"
        if "valid_bleu" in record
        else ""
    )
    return f"step {record['step']} | {losses}{bleu} | best {best.metric} {best.text()}"
