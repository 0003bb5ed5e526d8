"""Checkpoints that survive a crash at any moment, and that cannot run code when loaded.

DeepSpeed's save_checkpoint has global rank 0 rewrite SAVE_DIR/latest as soon as rank 0's own files
are written, while other ranks may still be writing theirs, and rewrites it in place: a job killed at
the wrong moment leaves `latest` naming a half-written checkpoint, or an empty `latest`. fathom saves
with save_latest=False and commits the checkpoint itself:

1. every rank writes its files (DeepSpeed, through CommittingCheckpointEngine) and fsyncs them;
2. the ranks gather the names and sizes of the files they wrote; after that, global rank 0 writes
   TAG/fathom_manifest.json, then points `latest` at TAG with an atomic rename: a best checkpoint
   (best_TAG) too, since it is also the newest; for one, the `best` link moves to TAG the same way and
   the previous best's directory is removed.

A tag directory with a manifest is complete; `latest` and `best` only ever name complete ones. Before
resuming, `verify` checks the manifest's files and sizes, so a checkpoint damaged afterwards (a
truncated copy, a full disk) is a one-line error instead of a traceback from deep inside DeepSpeed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from fathom.common.checkpoint_format import (
    MANIFEST,
    deepspeed_state_types,
    file_damage,
    file_entry,
    load_file,
    model_states,
    new_manifest,
    read_manifest,
    write_manifest,
)
from fathom.common.errors import ConfigError
from fathom.common.files import fsync_dir, save_file, unique_sibling, write_atomic
from fathom.common.run_layout import BEST, CONFIG_FILE, LATEST, best_tag, latest_tag, leftovers, linked_best, step_tag
from fathom.common.sections import OnResume
from fathom.corpus.batches import ParallelCorpus
from fathom.corpus.dataset import PreparedData, check_vocab
from fathom.model.model_section import scheme_options
from fathom.model.trained import check_same_model, model_config
from fathom.pipeline.checkpoint.data_position import resume_position, saved_position
from fathom.pipeline.checkpoint.reshape import (
    Shape,
    engine_shape,
    prepare_reshape,
    remove_universal,
    saved_shape,
    sharded,
)
from fathom.pipeline.config.deepspeed_values import precision
from fathom.pipeline.config.history import read_back, shown
from fathom.pipeline.config.resume_rules import flat, optimizer_layout, setting, settings_with
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.engine.internals import checkpoint_engine, set_checkpoint_engine, universal_loading
from fathom.pipeline.world.distributed import end_distributed


class CommittingCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, plus: every file written is fsynced and remembered (for the
    manifest), and every file read is read with weights_only."""

    def __init__(self, zipfile_serialization: bool):
        super().__init__(config_params=None)
        self.zipfile_serialization = zipfile_serialization
        self.written: dict[str, dict[str, Any]] = {}

    def save(self, state_dict: Any, path: str) -> None:
        save_file(state_dict, path, self.zipfile_serialization)
        self.written[Path(path).name] = file_entry(Path(path))

    def load(self, path: str, map_location: Any = None) -> Any:
        # DeepSpeed loads only checkpoints every rank has just verified together (verify_contents, before
        # --resume and train.init_from): reading each file's checksums again would double the I/O.
        return load_file(path, map_location, allowed=deepspeed_state_types(), verify=False)


def install(engine: deepspeed.DeepSpeedEngine) -> None:
    # DeepSpeed's torch checkpoint engine: the config check refused every setting that picks another
    # (checkpoint.writer, datastates_ckpt: pipeline/config/deepspeed_sections.py).
    current: TorchCheckpointEngine = checkpoint_engine(engine)
    set_checkpoint_engine(engine, CommittingCheckpointEngine(current.zipfile_serialization))


def link_atomic(path: Path, target: str) -> None:
    """Points the symlink `path` at `target` in one rename (over a plain directory of an older run, too)."""
    if path.is_dir() and not path.is_symlink():
        path.rename(path.with_name(f"{path.name}_legacy"))
    tmp = unique_sibling(path)
    tmp.symlink_to(target)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save(
    engine: deepspeed.PipelineEngine, save_dir: str | Path, client_state: dict[str, Any], best: bool, schedule_step: int
) -> str:
    """Saves and commits one checkpoint on all ranks, its manifest recording the schedule step its
    step-dependent values belong to (checkpoint.schedule_step); returns its tag."""
    save_dir = Path(save_dir)
    tag = best_tag(engine.global_steps) if best else step_tag(engine.global_steps)
    writer: CommittingCheckpointEngine = checkpoint_engine(engine)
    if dist.get_rank() == 0:
        # A manifest left from an earlier attempt at this tag must not vouch for files being rewritten
        # (DeepSpeed's save starts with a barrier, so no rank writes before this is gone).
        (save_dir / tag / MANIFEST).unlink(missing_ok=True)
    writer.written = {}
    try:
        engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False)
    except OSError as err:
        last = latest_tag(save_dir)
        resume = f"--resume continues from {last}" if last else "the run has no checkpoint yet"
        raise OSError(err.errno, f"{err.strerror} while saving {tag}; free space or fix the directory ({resume})",
                      err.filename) from None  # fmt: skip
    every_rank: list[dict[str, dict[str, Any]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every_rank, writer.written)
    if dist.get_rank() == 0:
        files = {name: entry for written in every_rank for name, entry in written.items()}
        shape, world_size = engine_shape(engine).record(), dist.get_world_size()
        write_manifest(save_dir / tag, new_manifest(tag, engine.global_steps, schedule_step, files, shape, world_size))
        # A best checkpoint is a whole checkpoint, and the newest: `latest` names it too, so a stop before
        # the next global_stepN resumes from it, and nothing deletes the tag `latest` names.
        write_atomic(save_dir / LATEST, tag)
        if best:
            previous = linked_best(save_dir)
            link_atomic(save_dir / BEST, tag)
            if previous is not None and previous != tag:
                shutil.rmtree(save_dir / previous, ignore_errors=True)
        remove_universal(save_dir)  # what a resume on a new shape loaded: this checkpoint replaces it
    dist.barrier()
    return tag


def load(
    engine: deepspeed.PipelineEngine, save_dir: str | Path, cfg: RunConfig, corpus: ParallelCorpus
) -> tuple[dict[str, Any], int]:
    """Resumes from the latest (committed) checkpoint; returns its client state and the micro-batches
    the run had read, as an index into this launch's order of them (data_position.resume_position)."""
    save_dir = Path(save_dir)
    trained = json.loads((save_dir / CONFIG_FILE).read_text())  # the run's, until this launch records its own
    committed = verify_contents(save_dir)
    reshaped = None if committed is None else prepare_reshape(engine, *committed)
    try:
        if reshaped is None:
            _, client_state = engine.load_checkpoint(str(save_dir))
        else:
            with universal_loading(engine):
                _, client_state = engine.load_checkpoint(str(save_dir), tag=reshaped[0])
    except RuntimeError as err:  # e.g. a state dict that does not fit the model, if check_resume was skipped
        first = (str(err).strip().splitlines() or ["RuntimeError"])[0]
        raise ConfigError(f"{save_dir}: the latest checkpoint does not fit this model ({first})") from None
    checkpoint = save_dir / latest_tag(save_dir)  # the checkpoint the user knows, not its universal copy
    replicas = engine.grid.get_data_parallel_world_size()
    saved = recorded_position(checkpoint, client_state, engine.global_steps, replicas, trained)
    consumed, where = resume_position(saved, cfg, corpus, checkpoint)
    if dist.get_rank() == 0:
        if reshaped is not None:
            print(f"fathom: resuming {reshaped[1]}", flush=True)
        print(f"fathom: resumed from {checkpoint} at step {engine.global_steps}; {where}", flush=True)
        if removed := remove_uncommitted(save_dir):
            print(f"fathom: removed what crashed saves left: {', '.join(removed)}", flush=True)
    return client_state, consumed


def recorded_position(
    checkpoint: Path, state: dict[str, Any], steps: int, replicas: int, trained: dict[str, Any]
) -> dict[str, Any]:
    """The data position `checkpoint` (client `state`, taken after `steps` steps) records; `replicas`:
    this launch's, the only ones a checkpoint without a manifest resumes on (check_shape)."""
    manifest = read_manifest(checkpoint)
    saved_replicas = replicas if manifest is None else saved_shape(manifest).replicas
    return saved_position(state, steps, saved_replicas, trained)


def committed_files(save_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """(tag directory, manifest) of the latest checkpoint; None if there is none or it predates manifests."""
    tag = latest_tag(save_dir)
    if tag is None:
        return None
    checkpoint = Path(save_dir) / tag
    if not checkpoint.is_dir():
        raise ConfigError(f"{save_dir}/{LATEST} names '{tag}', which does not exist; restore it or start a new run")
    manifest = read_manifest(checkpoint)
    return None if manifest is None else (checkpoint, manifest)


def verify(save_dir: str | Path) -> None:
    """Fails in one line unless the latest checkpoint's files are all there at their saved sizes. Reads
    none of them (every rank runs it before launching), but for a manifest of fathom's first format
    without a schedule step, whose upgrade reads DeepSpeed's counters (checkpoint_format.upgrade_manifest)."""
    if (committed := committed_files(save_dir)) is None:
        return
    checkpoint, manifest = committed
    for name, entry in sorted(manifest["files"].items()):
        if problem := file_damage(checkpoint / name, entry, read=False):
            raise ConfigError(problem)


def verify_contents(save_dir: str | Path, weights_only: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """Every byte of the latest checkpoint (`weights_only`: of its layer files, what train.init_from
    reads) against its checksums, the files shared out among the ranks; all ranks agree, so that a
    damaged file ends every rank cleanly rather than one rank mid-load. Returns what committed_files
    does for it."""
    committed = committed_files(save_dir)
    problem = None
    if committed is not None:
        checkpoint, manifest = committed
        files = sorted((n, e) for n, e in manifest["files"].items() if not weights_only or n.startswith("layer_"))
        mine = files[dist.get_rank() :: dist.get_world_size()]
        problem = next((p for name, entry in mine if (p := file_damage(checkpoint / name, entry, read=True))), None)
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is None:
        return committed
    rank = dist.get_rank()
    end_distributed()  # every rank stops here, so all can meet and exit with status 2, not an abort
    if rank == 0:
        raise ConfigError(first)
    sys.exit(2)  # rank 0 reports it


def remove_uncommitted(save_dir: str | Path) -> list[str]:
    """Deletes what crashed saves left (run_layout.leftovers) and returns their names. Global rank 0 only."""
    removed = leftovers(Path(save_dir))
    for path in removed:
        shutil.rmtree(path)
    return [path.name for path in removed]


def check_resume(save_dir: str | Path, cfg: RunConfig, corpus: ParallelCorpus, world_size: int) -> None:
    """Fails in one line, before anything is written, unless this launch can continue the run in save_dir."""
    save_dir = Path(save_dir)
    if latest_tag(save_dir) is None:
        return
    if isinstance(corpus, PreparedData):
        check_vocab(save_dir, model_config(save_dir), corpus)
    check_same_model(save_dir, cfg.model, "--resume", "resume with the run's config, or choose another train.save_dir")
    trained = json.loads((save_dir / CONFIG_FILE).read_text())
    # a scheme's option left out is its default: the same setting as one written with that value
    before = {**flat(trained), **scheme_options(model_config(save_dir))}
    now = {**flat(read_back(cfg.to_dict())), **scheme_options(cfg.model)}
    for key in settings_with(OnResume.START_ONLY):
        if before.get(key) != now.get(key):
            raise ConfigError(
                f"--resume: {key} is {json.dumps(before.get(key))} in {save_dir} but {json.dumps(now.get(key))} "
                f"here; it acts only when a run starts, which this one did: resume with its value, or start a "
                "new run in another train.save_dir"
            )
    verify(save_dir)
    checkpoint = save_dir / latest_tag(save_dir)
    state = model_states(checkpoint) or {}  # read once: without ZeRO it holds stage 0's optimizer state
    check_optimizer_state(save_dir, checkpoint, cfg.deepspeed, state)
    check_shape(save_dir, checkpoint, setting(trained, "pipeline.stages"), cfg, world_size, state)
    replicas = world_size // cfg.stages
    resume_position(recorded_position(checkpoint, state, state.get("global_steps", 0), replicas, trained), cfg,
                    corpus, checkpoint)  # fmt: skip


def check_shape(
    save_dir: Path, checkpoint: Path, stages: int, cfg: RunConfig, world_size: int, state: dict[str, Any]
) -> None:
    """Fails in one line unless this launch can continue the checkpoint on its shape: a new stage count
    or replica count needs a checkpoint fathom can reshape (pipeline/checkpoint/reshape.py). The data goes
    on from the first micro-batch not read, on any shape (pipeline/checkpoint/data_position.py)."""
    manifest = read_manifest(checkpoint)
    replicas = world_size // cfg.stages
    restart = f"or start a new run from its weights with train.init_from={save_dir}"
    if manifest is None:  # written before fathom recorded shapes: only its own shape loads it
        was = Shape(stages, state.get("dp_world_size", replicas))
        if (was.stages, was.replicas) != (cfg.stages, replicas):
            raise ConfigError(
                f"--resume: {checkpoint.name} was written as {was} before fathom reshaped checkpoints; resume as "
                f"{was}, {restart}"
            )
        return
    if manifest["shape"] is None:
        raise ConfigError(
            f"--resume: {checkpoint} records no pipeline shape, as an average of checkpoints does: it holds weights "
            "only, no optimizer or data state to go on from; start a new run from its weights with "
            f"train.init_from={save_dir}, or write the tag of a training checkpoint into {save_dir / LATEST}"
        )
    saved = saved_shape(manifest)
    if (saved.stages, saved.replicas) == (cfg.stages, replicas):
        return
    if not state.get("ds_config"):
        raise ConfigError(f"--resume: {checkpoint.name} was not written by DeepSpeed's engine; resume as {saved}")
    if not sharded(manifest) and saved.stages != cfg.stages:
        raise ConfigError(
            f"--resume: {checkpoint.name} keeps its optimizer state per stage without ZeRO (zero_optimization.stage "
            f"0), which DeepSpeed cannot reshape; resume with {saved.stages} stages, {restart}"
        )


ENABLE = {"bf16": "bf16.enabled=true", "fp16": "fp16.enabled=true", "fp32": "bf16.enabled=false and fp16.enabled=false"}


def check_optimizer_state(save_dir: Path, checkpoint: Path, ds: dict[str, Any], state: dict[str, Any]) -> None:
    """Fails in one line unless the checkpoint's optimizer state (DeepSpeed's, in the form its precision,
    ZeRO stage and optimizer gave it: its model states `state` say) is one this config's engine can load
    and go on with."""
    saved = state.get("ds_config")
    if saved is None:  # not written by DeepSpeed's engine
        return
    restart = f"or start a new run from its weights with train.init_from={save_dir}"
    if (was := precision(saved)) != (now := precision(ds)):
        raise ConfigError(
            f"--resume: {checkpoint.name} was trained in {was} and this config trains in {now}; its optimizer state "
            f"is kept in {was}'s form: resume with {ENABLE[was]}, {restart}"
        )
    before, after = optimizer_layout(saved), optimizer_layout(ds)
    for key in sorted(before.keys() | after.keys()):
        if (was := shown(before, key)) != (now := shown(after, key)):
            raise ConfigError(
                f"--resume: {key} is {was} in {checkpoint.name} but {now} here; its optimizer state needs the "
                f"optimizer it was saved with: resume with that, {restart}"
            )
