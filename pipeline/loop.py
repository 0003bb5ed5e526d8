"""The training loop on every rank: from the engine's step to train.max_steps (or train.max_epochs' end),
each step logged, validated and saved as the config says; or to a stop the ranks agreed on after a step,
saved first. train.py brings the engine to its start point and hands it here."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from fathom.common.checkpoint_format import ClientState
from fathom.common.run_layout import GRAD_NORMS_FILE, METRICS_FILE, latest_tag
from fathom.corpus.batches import DataPosition, MicroBatches, ParallelCorpus
from fathom.model.norms import build_scheme
from fathom.model.schedule import ScheduleHook
from fathom.pipeline.checkpoint import saving
from fathom.pipeline.checkpoint.data_position import data_order, position_record
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.patches import patch_training
from fathom.pipeline.reports.metrics import MetricsLog
from fathom.pipeline.safety.signals import Stopper
from fathom.pipeline.safety.watchdog import Watchdog
from fathom.pipeline.validation import Best, Validation, validation_line


@dataclass(frozen=True)
class StartPoint:
    """Where the loop starts: the step train.init_from's weights started the schedules at, and the
    micro-batches the run had read (an index into this launch's order of them)."""

    schedule_offset: int = 0
    consumed: int = 0


@dataclass(frozen=True)
class Stop:
    """A run stopped before its end, everything saved: why (a Stopper reason code), after which step, and
    the checkpoint --resume continues from."""

    reason: int
    step: int
    tag: str


def updates(engine: deepspeed.PipelineEngine, offset: int) -> int:
    """The step the schedules see (BranchNorm's t): updates applied, plus where train.init_from's weights
    started (`offset`). DeepSpeed counts a skipped step in global_steps; its LR schedule does not move
    on one, nor does fairseq's update counter, so neither does alpha_t."""
    return offset + engine.global_steps - engine.skipped_steps


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def train_step(engine: deepspeed.PipelineEngine, data: MicroBatches) -> dict[str, Any]:
    """One optimizer step over `accumulation` micro-batches; returns its metrics."""
    tokens_before = data.target_tokens
    lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step applies
    tick = time.perf_counter()
    loss = engine.train_batch(data_iter=data)
    elapsed = time.perf_counter() - tick
    # Only a replica's first and last stage load its micro-batches (one stage: once): count its first's.
    read = data.target_tokens - tokens_before if engine.is_first_stage() else 0
    tokens = torch.tensor(float(read), device=engine.device)  # nccl: GPU tensors only
    dist.all_reduce(tokens)
    tokens = tokens.item()
    return {
        "step": engine.global_steps,
        "loss": loss.item(),
        "grad_norm": _float(engine.get_global_grad_norm()),
        "lr": lr,
        "tokens": int(tokens),
        "tokens_per_s": tokens / elapsed,
    }


def progress_line(record: dict[str, Any], max_steps: int, seconds_per_step: float) -> str:
    extra = "".join(f" | {k} {record[k]:.4g}" for k in ("alpha", "loss_scale") if k in record)
    eta = seconds_per_step * (max_steps - record["step"])
    return (
        f"step {record['step']}/{max_steps} | loss {record['loss']:.4f}{extra} | "
        f"{record['tokens_per_s']:.0f} tok/s | eta {eta:.0f}s"
    )


def launch_position(engine: deepspeed.PipelineEngine, consumed: int = 0) -> DataPosition:
    """Which micro-batches this launch reads in each step, from its first, after `consumed` were read."""
    return DataPosition(
        consumed, engine.global_steps, engine.gradient_accumulation_steps(), engine.grid.get_data_parallel_world_size()
    )


class TrainingLoop:
    """One run's loop over an engine at its start point; `run()` trains it."""

    def __init__(
        self,
        engine: deepspeed.PipelineEngine,
        cfg: RunConfig,
        corpus: ParallelCorpus,
        start_point: StartPoint,
        watchdog: Watchdog,
        stopper: Stopper,
    ) -> None:
        self.engine, self.cfg, self.watchdog, self.stopper = engine, cfg, watchdog, stopper
        self.rank, self.save_dir = dist.get_rank(), Path(cfg.train.save_dir)
        self.scheme = build_scheme(cfg.model)
        self.hooks: list[Callable[[int], None]] = [ScheduleHook(engine.module)]
        self.position = launch_position(engine, start_point.consumed)
        self.data = MicroBatches(
            corpus,
            cfg.batch_size,
            cfg.train.seed,
            start=self.position.consumed,
            data_parallel_rank=engine.grid.get_data_parallel_rank(),
            data_parallel_size=self.position.replicas,
        )
        self.order, self.per_epoch = data_order(cfg, corpus), self.data.per_epoch
        self.validation = Validation(engine, cfg, watchdog) if cfg.train.valid_interval else None
        self.best = Best(cfg.train.best_metric, self.save_dir)
        if self.rank == 0 and self.best.tag is not None:
            print(f"fathom: best valid {self.best.metric} so far {self.best.text()} ({self.best.tag})", flush=True)
            if warning := self.best.warning():
                print(f"fathom: warning: {warning}", file=sys.stderr, flush=True)
        self.offset = start_point.schedule_offset
        self.metrics = MetricsLog(self.save_dir / METRICS_FILE, self.rank == 0, engine.global_steps,
                                  monitor=engine.monitor)  # fmt: skip
        interval = cfg.train.grad_norm_interval
        grad_norms = MetricsLog(self.save_dir / GRAD_NORMS_FILE, self.rank == 0 and interval > 0,
                                resume_step=engine.global_steps)  # fmt: skip
        self.patches = patch_training(
            engine, cfg.model, cfg.train.seed, self.position, interval, grad_norms.write,
            self.save_dir if cfg.train.time_breakdown else None,
        )  # fmt: skip
        self.last, self.limit = self.final_step()

    def final_step(self) -> tuple[int, str]:
        """The step the run ends after, and the setting that says so."""
        train = self.cfg.train
        if train.max_epochs is not None:
            end = self.position.step_ending(train.max_epochs * self.per_epoch)
            if end < train.max_steps:
                return end, f"train.max_epochs {train.max_epochs} ends at step {end}"
        return train.max_steps, f"train.max_steps is {train.max_steps}"

    def client_state(self) -> dict[str, Any]:
        where = position_record(self.position.at(self.engine.global_steps), self.per_epoch, self.order)
        return ClientState(self.best.state(), self.offset, where).to_dict()

    def save(self, as_best: bool, why: str = "") -> None:
        engine = self.engine
        self.watchdog.progress(f"checkpoint save after step {engine.global_steps}{why}")
        saving.save(engine, self.save_dir, self.client_state(), best=as_best,
                    schedule_step=updates(engine, self.offset))  # fmt: skip

    def step(self) -> dict[str, Any]:
        """One optimizer step with the schedules at its t and dropout seeded for it; its record, logged."""
        engine, patches = self.engine, self.patches
        step, t = engine.global_steps, updates(engine, self.offset)
        self.watchdog.progress(f"training step {step + 1}")
        for hook in self.hooks:
            hook(t)
        patches.masks.start(step)
        with patches.breakdown.step() if patches.breakdown else contextlib.nullcontext():
            record = {**train_step(engine, self.data), **self.scheme.step_metrics(t), **patches.guard.step_record()}
        self.metrics.write(record)
        if patches.guard.found is not None:
            patches.guard.enforce(self.cfg.train.on_nonfinite, record["step"], latest_tag(self.save_dir))
        return record

    def validate(self, done: int) -> None:
        """Validation after step `done`, its record logged, and the best checkpoint saved if it improved."""
        for hook in self.hooks:  # the model after step s is evaluated (and exported) at its schedule step
            hook(updates(self.engine, self.offset))
        record = self.validation(done)
        improved = self.best.update(record[f"valid_{self.best.metric}"])
        self.metrics.write({**record, **self.best.record()})  # before the save: a resume from it keeps this record
        if self.rank == 0:
            print(validation_line(record, self.best), flush=True)
        if improved:
            self.save(as_best=True)

    def run(self) -> Stop | None:
        """Trains to the last step (None), or to a stop the ranks agreed on (the Stop), saved first."""
        engine, train, last = self.engine, self.cfg.train, self.last
        started, first_step = time.perf_counter(), engine.global_steps
        if first_step >= last and self.rank == 0:
            print(f"fathom: the run is at step {first_step} and {self.limit}: nothing to train; raise it to go on",
                  flush=True)  # fmt: skip
        while engine.global_steps < last:
            record = self.step()
            done = record["step"]
            if self.rank == 0 and train.compile and done == first_step + 1:
                seconds = time.perf_counter() - started
                print(f"fathom: step {done} took {seconds:.1f} s, compiling the Transformer layers included",
                      flush=True)  # fmt: skip
            if self.rank == 0 and (done % train.log_interval == 0 or done == last):
                seconds_per_step = (time.perf_counter() - started) / (done - first_step)
                print(progress_line(record, last, seconds_per_step), flush=True)
            if self.validation and (done % train.valid_interval == 0 or done == last):
                self.validate(done)
            saved = done % train.save_interval == 0 or done == last
            if saved:
                self.save(as_best=False)
            if done < last and (reason := self.stopper.agreed(engine.device)):
                if not saved:  # a signal during the step's own save is answered here, by that save
                    self.save(as_best=False, why=", to stop")
                self.stopper.saved()
                return Stop(reason, done, latest_tag(self.save_dir))
        if self.patches.breakdown and self.rank == 0:
            print("\n".join(self.patches.breakdown.summary()), flush=True)
        if self.cfg.settings.comms_logger:
            # DeepSpeed times its communication ops and leaves printing them to the training loop (every rank
            # meets in it; rank 0 prints).
            deepspeed.comm.log_summary()
        return None
