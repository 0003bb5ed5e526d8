"""The training loop: builds the PipelineModule, runs DeepSpeed's engine, logs, checkpoints, resumes.

deepspeed --num_gpus S scripts/train.py --config ds_configs/NAME.json [--override k=v ...] [--resume]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from model.config import ConfigError, ModelConfig, exit_on_config_error
from model.loss import label_smoothed_cross_entropy
from model.norms import build_scheme
from pipeline import admin
from pipeline.checkpoint import CONFIG_FILE, check_init_from, checkpoint_dir
from pipeline.config import RunConfig, load_config
from pipeline.corpus import BinarizedCorpus
from pipeline.data import MicroBatch, MicroBatches, ParallelCorpus, SyntheticTranslation, eval_batches
from pipeline.hooks import ScheduleHook, StepHook
from pipeline.layers import TRANSFORMER_LAYERS, layer_specs
from pipeline.memory import current_bytes, report_peaks
from pipeline.partition import CostBalancedPipeline

METRICS_FILE = "metrics.jsonl"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="experiment JSON (DeepSpeed keys + model/data/train)")
    parser.add_argument(
        "--override", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help="e.g. model.encoder_layers=24"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.save_dir")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    return parser.parse_args(argv)


def build_corpus(cfg: RunConfig, split: str = "train") -> ParallelCorpus:
    if cfg.data.path is None:
        return SyntheticTranslation(cfg.data.synthetic, split)
    return BinarizedCorpus(cfg.data.path, split)


def with_vocab(cfg: ModelConfig, corpus: ParallelCorpus) -> ModelConfig:
    for key, size in (("src_vocab_size", corpus.src_vocab_size), ("tgt_vocab_size", corpus.tgt_vocab_size)):
        if getattr(cfg, key) not in (None, size):
            raise ConfigError(f"model.{key}: {getattr(cfg, key)} but the data's dictionary has {size}; remove the key")
    return dataclasses.replace(cfg, src_vocab_size=corpus.src_vocab_size, tgt_vocab_size=corpus.tgt_vocab_size)


def build_pipeline(cfg: RunConfig) -> PipelineModule:
    """Each rank builds only the layers of its own stage (LayerSpecs are lazy)."""
    options = dict(
        layers=[spec for _, spec in layer_specs(cfg.model)],
        num_stages=cfg.stages,
        loss_fn=partial(label_smoothed_cross_entropy, smoothing=cfg.train.label_smoothing),
        checkpointable_layers=TRANSFORMER_LAYERS,
        dynamic_shape=True,  # micro-batches differ in length; without it DeepSpeed truncates silently
        seed_layers=True,  # layer i is initialized from seed + i, whatever the stage count
        base_seed=cfg.train.seed,
        seed_fn=lambda seed: torch.manual_seed(int(seed)),  # DeepSpeed may pass a numpy int
    )
    if cfg.partition == "cost":
        module = CostBalancedPipeline(model=cfg.model, **options)
    else:
        module = PipelineModule(partition_method=cfg.partition, **options)
    # seed_layers also reseeds every forward from a counter that a resume restarts; dropout is
    # seeded per step by the loop instead, so turn it off once the layers are built.
    module.seed_layers = False
    return module


def build_engine(cfg: RunConfig) -> deepspeed.DeepSpeedEngine:
    module = build_pipeline(cfg)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=copy.deepcopy(cfg.deepspeed),
    )
    if engine.grid.get_data_parallel_world_size() == 1 and engine.zero_optimization_stage() == 0:
        # Nothing to average, yet DeepSpeed would copy every gradient into one flat buffer, all-reduce
        # it with itself and copy it back, every step (ZeRO-1 needs its reduce step: it builds the
        # gradient partition there).
        engine.pipeline_enable_backward_allreduce = False
    return engine


def load_weights(engine: deepspeed.PipelineEngine, checkpoint: Path) -> None:
    """This stage's layers from a checkpoint's per-layer files, with DeepSpeed's own loader (which
    also synchronizes tied weights across stages); optimizer state starts fresh."""
    engine.module.load_state_dir(str(checkpoint), checkpoint_engine=engine.checkpoint_engine)
    if hasattr(engine.optimizer, "refresh_fp32_params"):  # ZeRO's fp32 master copies
        engine.optimizer.refresh_fp32_params()


def profile_batch(cfg: RunConfig, corpus: ParallelCorpus) -> MicroBatch:
    """The first micro-batch of the run, the same on every rank."""
    return next(MicroBatches(corpus, cfg.batch_size, cfg.train.seed))


def step_seed(seed: int, step: int, rank: int) -> int:
    """Dropout's RNG depends only on (seed, step, rank), so a resumed run draws the same masks."""
    return (seed * 1_000_003 + step) * 4099 + rank


class MetricsLog:
    """<save_dir>/metrics.jsonl, one JSON line per global step, written by global rank 0 only."""

    def __init__(self, path: Path, enabled: bool, resume_step: int):
        self.path, self.enabled = path, enabled
        if enabled and path.exists():
            # Steps after the checkpoint we resume from will be trained again: drop their old lines.
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def init_distributed() -> None:
    """nccl on GPUs, gloo on CPUs; CPU ranks on one machine split its cores instead of oversubscribing."""
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        release_shm_buffer()
        return_freed_tensors()


def return_freed_tensors() -> None:
    """glibc raises its mmap threshold as large blocks are freed, after which freed tensors stay in
    its heap: a CPU run then peaks ~20% above the bytes it uses (measured on a 44M-parameter ZeRO-1
    run: 1.71 vs 1.40 GiB). A fixed threshold hands every block over 128 KiB back when freed."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def shm_buffer() -> Path:
    """The /dev/shm segment DeepSpeed's CPU all-reduce creates for this rank (ops/csrc/cpu/comm/shm.cpp)
    when all ranks are on one machine."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"


def release_shm_buffer() -> None:
    """DeepSpeed never removes its 66 MB per-rank segment, so every CPU run would keep that much RAM
    per rank until reboot. Each rank maps every peer's segment inside init_distributed, so after a
    barrier the names can go: the mappings stay valid until the processes exit, however they exit."""
    dist.barrier()
    shm_buffer().unlink(missing_ok=True)


def train_step(engine: deepspeed.DeepSpeedEngine, data: MicroBatches, stages: int) -> dict[str, Any]:
    """One optimizer step over `accumulation` micro-batches; returns its metrics."""
    tokens_before = data.target_tokens
    lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step applies
    tick = time.perf_counter()
    loss = engine.train_batch(data_iter=data)
    elapsed = time.perf_counter() - tick
    # Every stage of a data-parallel replica reads the same micro-batches: count each once.
    tokens = torch.tensor(float(data.target_tokens - tokens_before))
    dist.all_reduce(tokens)
    tokens = tokens.item() / stages
    return {
        "step": engine.global_steps,
        "loss": loss.item(),
        "grad_norm": _float(engine.get_global_grad_norm()),
        "lr": lr,
        "tokens": int(tokens),
        "tokens_per_s": tokens / elapsed,
    }


def validate(engine: deepspeed.DeepSpeedEngine, batches: list[MicroBatch]) -> float:
    """Mean loss over the validation micro-batches, each data-parallel replica taking a share."""
    grid = engine.grid
    mine = batches[grid.get_data_parallel_rank() :: grid.get_data_parallel_world_size()]
    loss = engine.eval_batch(iter(mine), num_micro_batches=len(mine)) if mine else torch.tensor(0.0)
    total = torch.tensor([loss.item() * len(mine), float(len(mine))])
    dist.all_reduce(total, group=grid.get_data_parallel_group())
    return (total[0] / total[1]).item()


def progress_line(record: dict[str, Any], max_steps: int, seconds_per_step: float) -> str:
    extra = "".join(f" | {k} {record[k]:.4g}" for k in ("alpha",) if k in record)
    eta = seconds_per_step * (max_steps - record["step"])
    return (
        f"step {record['step']}/{max_steps} | loss {record['loss']:.4f}{extra} | "
        f"{record['tokens_per_s']:.0f} tok/s | eta {eta:.0f}s"
    )


def train(cfg: RunConfig, corpus: ParallelCorpus, resume: bool) -> None:
    init_distributed()
    baseline_memory = current_bytes()
    rank = dist.get_rank()
    save_dir = Path(cfg.train.save_dir)
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    engine = build_engine(cfg)
    best = float("inf")
    if resume and (save_dir / "latest").exists():
        _, client_state = engine.load_checkpoint(str(save_dir))
        best = client_state.get("best_valid_loss", best)
        if rank == 0:
            print(f"fathom: resumed from {save_dir} at step {engine.global_steps}", flush=True)
    elif resume and rank == 0:
        print(f"fathom: no checkpoint in {save_dir} yet; starting from step 0", flush=True)

    if cfg.train.init_from and engine.global_steps == 0:
        load_weights(engine, checkpoint_dir(cfg.train.init_from))
        if rank == 0:
            print(f"fathom: initialized from {cfg.train.init_from}", flush=True)
    scheme = build_scheme(cfg.model)
    # A resumed or initialized run has its omegas in the checkpoint.
    if scheme.profiled and engine.global_steps == 0 and not cfg.train.init_from:
        message = admin.initialize(engine, cfg.model, profile_batch(cfg, corpus), save_dir)
        if rank == 0:
            print(f"fathom: {message}", flush=True)
    hooks: list[StepHook] = [ScheduleHook(engine.module)]
    data = MicroBatches(
        corpus,
        cfg.batch_size,
        cfg.train.seed,
        start_step=engine.global_steps,
        accumulation=engine.gradient_accumulation_steps(),
        data_parallel_rank=engine.grid.get_data_parallel_rank(),
        data_parallel_size=engine.grid.get_data_parallel_world_size(),
    )
    valid = eval_batches(build_corpus(cfg, "valid"), cfg.batch_size) if cfg.train.valid_interval else []
    metrics = MetricsLog(save_dir / METRICS_FILE, enabled=rank == 0, resume_step=engine.global_steps)
    started, first_step = time.perf_counter(), engine.global_steps
    while engine.global_steps < cfg.train.max_steps:
        step = engine.global_steps
        for hook in hooks:
            hook(step)
        torch.manual_seed(step_seed(cfg.train.seed, step, rank))
        record = {**train_step(engine, data, cfg.stages), **scheme.step_metrics(step)}
        metrics.write(record)
        done = record["step"]
        if rank == 0 and (done % cfg.train.log_interval == 0 or done == cfg.train.max_steps):
            seconds_per_step = (time.perf_counter() - started) / (done - first_step)
            print(progress_line(record, cfg.train.max_steps, seconds_per_step), flush=True)
        if valid and (done % cfg.train.valid_interval == 0 or done == cfg.train.max_steps):
            for hook in hooks:  # the model after step s is evaluated (and exported) at step s
                hook(done)
            valid_loss = validate(engine, valid)
            if valid_loss < best:
                best = valid_loss
                engine.save_checkpoint(
                    str(save_dir), tag="best", client_state={"best_valid_loss": best}, save_latest=False
                )
            metrics.write({"step": done, "valid_loss": valid_loss, "best_valid_loss": best})
            if rank == 0:
                print(f"step {done} | valid loss {valid_loss:.4f} | best {best:.4f}", flush=True)
        if done % cfg.train.save_interval == 0 or done == cfg.train.max_steps:
            engine.save_checkpoint(str(save_dir), client_state={"best_valid_loss": best})
    report_peaks(baseline_memory, engine.stage_id, save_dir)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error(report=int(os.environ.get("RANK", 0)) == 0):
        cfg = load_config(args.config, args.override, world_size=int(os.environ.get("WORLD_SIZE", 1)))
        corpus = build_corpus(cfg)
        cfg.model = with_vocab(cfg.model, corpus)
        admin.check(cfg.model)
        if cfg.train.init_from:
            check_init_from(cfg.train.init_from, cfg.model)
        save_dir = Path(cfg.train.save_dir)
        if not args.resume and (save_dir / "latest").exists():
            raise ConfigError(
                f"train.save_dir: {save_dir} already holds checkpoints; pass --resume to continue them "
                "or choose another save_dir"
            )
    train(cfg, corpus, args.resume)
    # Torn down here rather than at interpreter exit, where one CI run's process aborted after the run
    # had finished ("terminate called without an active exception", exit 250).
    dist.barrier()
    dist.destroy_process_group()
