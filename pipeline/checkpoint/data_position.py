"""Where a resumed run goes on reading its data: the first micro-batch it has not read.

A run reads one fixed sequence of micro-batches (corpus.batches.MicroBatches). Every checkpoint records
how many it had read, and what decides which pairs the n-th one holds (the order): the training data,
the token budget or micro-batch size, and the seed. A resume whose order is the checkpoint's reads on
from there, whatever its accumulation, replica count or stage count. One that changed the order cannot
find "the next unseen micro-batch" in it: it is refused before launch, or with train.on_data_change
next_epoch it starts the new order at the next epoch's start.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fathom.common.checkpoint_format import ClientState
from fathom.common.errors import ConfigError
from fathom.common.sections import OnResume
from fathom.corpus.batches import BatchSize, ParallelCorpus, epoch_length
from fathom.pipeline.config.deepspeed_values import accumulation
from fathom.pipeline.config.history import read_back
from fathom.pipeline.config.resume_rules import setting, settings_with
from fathom.pipeline.config.run_config import RunConfig

MICRO_BATCH = "train_micro_batch_size_per_gpu"


def data_order(cfg: RunConfig, corpus: ParallelCorpus) -> dict[str, Any]:
    """What decides which pairs each micro-batch holds: the settings declared DATA_ORDER
    (pipeline/config/resume_rules.py), by key, in the order a change is reported, as the order sees them:
    data.path as the training pairs themselves (their checksums, or the synthetic task's settings: whichever
    key changed them, it is reported as data.path), the micro-batch size as None under a token budget,
    which alone decides then."""
    config = read_back(cfg.to_dict())
    seen_as = {"data.path": corpus.fingerprint(), MICRO_BATCH: cfg.batch_size.sentences}
    return {key: seen_as[key] if key in seen_as else setting(config, key) for key in settings_with(OnResume.DATA_ORDER)}


def position_record(consumed: int, per_epoch: int | None, order: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps: micro-batches read, how many make an epoch (None: not recorded), and the
    order they came in."""
    return {"micro_batches": consumed, "per_epoch": per_epoch, "order": order}


def saved_position(state: Mapping[str, Any], steps: int, replicas: int, trained: Mapping[str, Any]) -> dict[str, Any]:
    """The position a checkpoint's client `state` records. One written before positions were recorded
    had read `accumulation x replicas` micro-batches a step (then the only rule), in the order its run's
    config (`trained`, config.json) gave; its data was not recorded, so it is not compared."""
    if (position := ClientState.read(state).data_position) is not None:
        return position
    max_tokens = trained["data"].get("max_tokens")
    order = {
        "data.max_tokens": max_tokens,
        MICRO_BATCH: None if max_tokens is not None else setting(trained, MICRO_BATCH),
        "train.seed": trained["train"]["seed"],
    }
    micro_batches = accumulation(state.get("ds_config", trained), replicas) * replicas
    return position_record(steps * micro_batches, None, order)


def changed_setting(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """The first setting whose change puts other pairs in the n-th micro-batch (one a checkpoint did not
    record is not compared)."""
    return next((key for key, value in now.items() if key in saved and saved[key] != value), None)


def next_epoch(saved: Mapping[str, Any], corpus: ParallelCorpus) -> int:
    """The epoch (from 0) after the one the checkpoint was in; the one it had reached if it stopped
    exactly at its start."""
    per_epoch = saved["per_epoch"]
    if per_epoch is None:  # recorded before positions were: the same data, in the checkpoint's batches
        order = saved["order"]
        size = BatchSize(sentences=order[MICRO_BATCH], max_tokens=order["data.max_tokens"])
        per_epoch = epoch_length(corpus.lengths(), size, order["train.seed"])
    return -(-saved["micro_batches"] // per_epoch)


def refusal(key: str, was: Any, now: Any, checkpoint: str, epoch: int) -> str:
    choice = f"or set train.on_data_change=next_epoch to start epoch {epoch + 1} in the new order"
    if key == "data.path":
        return (
            f"--resume: data.path holds other training pairs than {checkpoint} was trained on, so the run cannot go "
            f"on from the first micro-batch it has not read: resume on that data, {choice}"
        )
    return (
        f"--resume: {key} is {json.dumps(was)} in {checkpoint} but {json.dumps(now)} here, which puts other pairs in "
        f"every micro-batch, so the run cannot go on from the first one it has not read: resume with "
        f"{key}={json.dumps(was)}, {choice}"
    )


def resume_position(
    saved: Mapping[str, Any], cfg: RunConfig, corpus: ParallelCorpus, checkpoint: str | Path
) -> tuple[int, str]:
    """The index, in this launch's order, of the first micro-batch a resume reads, and what to say of
    it; ConfigError when the order changed and train.on_data_change is refuse."""
    now = data_order(cfg, corpus)
    changed = changed_setting(saved["order"], now)
    if changed is None:
        consumed = saved["micro_batches"]
        # The same order has the checkpoint's epochs: only one from before positions were recorded lacks the
        # count, which would otherwise cost a pass over the corpus's lengths at every launch.
        per_epoch = saved["per_epoch"] or epoch_length(corpus.lengths(), cfg.batch_size, cfg.train.seed)
        epoch, read = divmod(consumed, per_epoch)
        return consumed, f"data from micro-batch {consumed} (epoch {epoch + 1}: {read} of {per_epoch} read)"
    epoch = next_epoch(saved, corpus)
    if cfg.train.on_data_change == "refuse":
        raise ConfigError(refusal(changed, saved["order"][changed], now[changed], Path(checkpoint).name, epoch))
    first = epoch * epoch_length(corpus.lengths(), cfg.batch_size, cfg.train.seed)
    return first, f"{changed} changed: data from micro-batch {first}, the start of epoch {epoch + 1} in the new order"
