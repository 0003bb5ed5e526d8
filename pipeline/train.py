"""One rank of a training job: builds the PipelineModule and DeepSpeed's engine, brings it to its start
point (a resume, train.init_from, Admin's profile), and trains it (loop.py).

deepspeed --num_gpus S scripts/train.py --config ds_configs/NAME.json [--override k=v ...] [--resume]
"""

from __future__ import annotations

import json
import signal
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from fathom.common.checkpoint_format import ClientState, schedule_step
from fathom.common.errors import exit_on_config_error
from fathom.common.files import write_atomic
from fathom.common.run_layout import (
    CONFIG_HISTORY,
    DEEPSPEED_CONFIG_FILE,
    checkpoint_dir,
    latest_tag,
)
from fathom.corpus.batches import MicroBatch, MicroBatches, ParallelCorpus
from fathom.corpus.dataset import PreparedData, write_dictionaries
from fathom.model.layers import compile_layers
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.norms import build_scheme
from fathom.pipeline.checkpoint import saving
from fathom.pipeline.checkpoint.run_directory import RunDirectory
from fathom.pipeline.config.deepspeed_settings import DeepSpeedSettings
from fathom.pipeline.config.deepspeed_values import precision_warning
from fathom.pipeline.config.engine_defaults import engine_config
from fathom.pipeline.config.history import record_config
from fathom.pipeline.config.inverse_sqrt import client_scheduler
from fathom.pipeline.config.resume_rules import applied_optimizer_arguments
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.engine import admin_profile
from fathom.pipeline.engine.cuda_graphs import graph_layers
from fathom.pipeline.engine.internals import checkpoint_engine, linear_duplicate_check
from fathom.pipeline.launch.checks import check_run, parse_train_args
from fathom.pipeline.loop import StartPoint, Stop, TrainingLoop
from fathom.pipeline.parts.specs import layer_specs
from fathom.pipeline.parts.stage_cuts import CostBalancedPipeline
from fathom.pipeline.parts.stage_modules import TRANSFORMER_LAYERS
from fathom.pipeline.patches import patch_engine
from fathom.pipeline.reports.memory import current_bytes, report_peaks
from fathom.pipeline.safety.divergence import NonFiniteError, exit_on_nonfinite
from fathom.pipeline.safety.launchers import watch_launchers
from fathom.pipeline.safety.peers import exit_on_lost_peer
from fathom.pipeline.safety.signals import LAUNCHER_ENDED, RESUMABLE_EXIT, Stopper
from fathom.pipeline.safety.watchdog import Watchdog, backend_timeout
from fathom.pipeline.world.distributed import check_mpi_discovery, init_distributed, launched_world
from fathom.pipeline.world.slurm import adopt_slurm_world


def build_pipeline(cfg: RunConfig) -> PipelineModule:
    """Each rank builds only the layers of its own stage (LayerSpecs are lazy)."""
    options = dict(
        layers=layer_specs(cfg.model),
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
    if cfg.train.compile:
        compile_layers(module)
    if cfg.train.cuda_graphs:
        graph_layers(module)
    # seed_layers also reseeds every forward from a counter that a resume restarts; dropout is
    # seeded per step by the loop instead, so turn it off once the layers are built.
    module.seed_layers = False
    return module


def build_engine(cfg: RunConfig) -> deepspeed.DeepSpeedEngine:
    module = build_pipeline(cfg)
    with linear_duplicate_check():
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            config=engine_config(cfg.deepspeed),
            lr_scheduler=client_scheduler(cfg.deepspeed),
        )
    patch_engine(engine)
    return engine


def load_weights(engine: deepspeed.PipelineEngine, checkpoint: Path) -> None:
    """This stage's layers from a checkpoint's per-layer files, with DeepSpeed's own loader (which
    also synchronizes tied weights across stages); optimizer state starts fresh."""
    engine.module.load_state_dir(str(checkpoint), checkpoint_engine=checkpoint_engine(engine))
    if hasattr(engine.optimizer, "refresh_fp32_params"):  # ZeRO's fp32 master copies
        engine.optimizer.refresh_fp32_params()


def apply_optimizer_settings(engine: deepspeed.PipelineEngine, settings: DeepSpeedSettings) -> None:
    """After a resume, the config's learning-rate schedule and optimizer hyperparameters from the first
    resumed step on. DeepSpeed's load restores the saved param groups: their betas, eps and weight decay
    would stay the checkpoint's, and their lr until the scheduler's first step, one step late."""
    params = {} if settings.optimizer is None else settings.optimizer.params
    for group in engine.optimizer.param_groups:
        for key in applied_optimizer_arguments():
            if key in params and key in group:
                group[key] = tuple(params[key]) if isinstance(group[key], tuple) else params[key]
    if engine.lr_scheduler is not None:  # the rate of the iteration the checkpoint's scheduler is at
        engine.lr_scheduler.step(engine.lr_scheduler.last_batch_iteration)


def profile_batch(cfg: RunConfig, corpus: ParallelCorpus) -> MicroBatch:
    """The first micro-batch of the run, the same on every rank."""
    return next(MicroBatches(corpus, cfg.batch_size, cfg.train.seed))


def start(engine: deepspeed.PipelineEngine, cfg: RunConfig, corpus: ParallelCorpus, resume: bool) -> StartPoint:
    """Brings the engine to where training starts: the latest checkpoint, train.init_from's weights or
    Admin's profiled omegas, and writes the run's records."""
    rank, save_dir = dist.get_rank(), Path(cfg.train.save_dir)
    resumed: dict[str, Any] = {}  # the checkpoint's client state
    consumed = 0
    if resume and latest_tag(save_dir) is not None:
        resumed, consumed = saving.load(engine, save_dir, cfg, corpus)
        apply_optimizer_settings(engine, cfg.settings)
    elif resume and rank == 0:
        print(f"fathom: no checkpoint in {save_dir} yet; starting from step 0", flush=True)
    if rank == 0:  # only now: a checkpoint that failed to load leaves the run's records as they were
        if changed := record_config(save_dir, cfg.to_dict(), engine.global_steps):
            print(f"fathom: from step {engine.global_steps + 1} on: {', '.join(changed)} ({CONFIG_HISTORY} "
                  "keeps each stretch's settings)", flush=True)  # fmt: skip
        write_atomic(save_dir / DEEPSPEED_CONFIG_FILE, json.dumps(engine.config, indent=2) + "\n")
        if isinstance(corpus, PreparedData):
            write_dictionaries(save_dir, corpus)
    offset = ClientState.read(resumed).schedule_offset
    if cfg.train.init_from and engine.global_steps == 0:
        saving.verify_contents(cfg.train.init_from, weights_only=True)
        source = checkpoint_dir(cfg.train.init_from)
        load_weights(engine, source)
        init_step = cfg.train.init_step
        offset = schedule_step(source) if init_step is None else init_step
        if rank == 0:
            print(f"fathom: initialized from {source}, schedules from step {offset}", flush=True)
    # A resumed or initialized run has its omegas in the checkpoint.
    if build_scheme(cfg.model).profiling() and engine.global_steps == 0 and not cfg.train.init_from:
        message = admin_profile.initialize(engine, cfg.model, profile_batch(cfg, corpus), save_dir)
        if rank == 0:
            print(f"fathom: {message}", flush=True)
    return StartPoint(offset, consumed)


def train(cfg: RunConfig, corpus: ParallelCorpus, resume: bool, stopper: Stopper | None = None) -> Stop | None:
    """Trains to the run's end (None), or until the ranks agree to stop (the Stop); `stopper`: the signal
    handlers main installed (None: no signal stops this run, but train.exit_after_minutes does)."""
    init_distributed(backend_timeout(cfg.train.hang_timeout), cfg.train.cpu_heap, cfg.train.startup_timeout)
    baseline_memory = current_bytes()
    rank = dist.get_rank()
    stopper = stopper or Stopper(rank)
    run_dir = RunDirectory(Path(cfg.train.save_dir), rank)
    try:
        run_dir.open()
        engine = build_engine(cfg)
        watchdog = Watchdog(run_dir.path, rank, dist.get_world_size(), cfg.train.hang_timeout).start()
        start_point = start(engine, cfg, corpus, resume)
        stopper.training(run_dir, watchdog, lambda: engine.global_steps, cfg.train.exit_after_minutes)
        watch_launchers(lambda ended: stopper.request(LAUNCHER_ENDED))
        try:
            stopped = TrainingLoop(engine, cfg, corpus, start_point, watchdog, stopper).run()
        finally:  # a run stopped by an error leaves no watchdog thread behind in a process that goes on
            watchdog.stop()
        report_peaks(baseline_memory, engine.stage_id, run_dir.path, cfg.auto_checkpointing)
        return stopped
    except NonFiniteError:  # a training outcome: its logs are the evidence
        stopper.ending()
        raise
    except Exception:
        stopper.ending()
        run_dir.abandon()
        raise
    finally:
        run_dir.close()


def main(argv: list[str] | None = None) -> int:
    """One rank of a training job; returns its exit status: 0, or RESUMABLE_EXIT when stopped and saved."""
    args = parse_train_args(argv, __doc__)
    with exit_on_config_error():
        adopt_slurm_world()  # srun's tasks: the world from Slurm's variables
    world = launched_world()
    stopper = Stopper(world.rank).install(signal.SIGUSR1)
    with exit_on_config_error(report=world.rank == 0):
        check_mpi_discovery()
        # A data directory is read whole for its checksums once per machine and launch: by the machine's
        # first rank, before the collectives that start training, so no rank trains on data it rejects.
        cfg, corpus = check_run(args, world.size, checksums=world.local_rank == 0)
    if world.rank == 0 and (warning := precision_warning(cfg.deepspeed)):
        print(f"fathom: warning: {warning}", file=sys.stderr, flush=True)
    if world.rank == 0 and cfg.auto_checkpointing is not None:
        print(f"fathom: {cfg.auto_checkpointing.line()}", flush=True)
    # A checkpoint that fails to load or save: the first rank reports it; another rank that alone hits
    # an error reports it after REPORTER_GRACE_S.
    stopper.install(signal.Signals[cfg.train.exit_signal])
    lost_peer = exit_on_lost_peer(Path(cfg.train.save_dir), world.rank, world.size, socket.gethostname())
    with exit_on_config_error(report=world.rank == 0), exit_on_nonfinite(report=world.rank == 0), lost_peer:
        stopped = train(cfg, corpus, args.resume, stopper)
    if stopped is None:
        return 0
    if world.rank == 0:
        print(stopper.stopped_line(stopped.reason, stopped.step, stopped.tag), file=sys.stderr, flush=True)
    return RESUMABLE_EXIT
