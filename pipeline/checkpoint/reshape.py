"""Resuming a run on another shape: another stage count, data-parallel size or partition.

A checkpoint's weights are one file per layer and load on any shape; its optimizer state does not:
ZeRO-1 keeps the fp32 master weights and Adam's moments as one flat partition per stage and
data-parallel rank. DeepSpeed's universal checkpoint stores them per parameter instead, which any shape
loads. On a --resume whose shape differs from the checkpoint's, global rank 0 converts the checkpoint
with DeepSpeed's own converter (`python -m deepspeed.checkpoint.ds_to_universal`) into TAG.universal
beside it, adds the layer files (DeepSpeed's pipeline loader reads the weights from there) and commits it
with a manifest, as training commits its checkpoints; every rank then loads it as a universal
checkpoint. The original is only read. The next checkpoint the run commits is in the new shape, and
the universal copy is removed then.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch.distributed as dist

from common.errors import ConfigError
from common.files import fsync_dir, unique_sibling, write_atomic
from common.run_layout import MANIFEST, file_damage, read_manifest
from pipeline.deepspeed_internals import stage_bounds

UNIVERSAL = ".universal"  # suffix of a checkpoint tag's universal form
STAGE_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
OPTIMIZER_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


@dataclass(frozen=True)
class Shape:
    """How a run is laid out: its stages, data-parallel replicas, and the first layer of each stage
    then the layer count (None when a checkpoint predates recording them)."""

    stages: int
    replicas: int
    bounds: tuple[int, ...] | None = None

    def __str__(self) -> str:
        def count(n: int, word: str) -> str:
            return f"{n} {word}{'' if n == 1 else 's'}"

        return f"{count(self.stages, 'stage')} x {count(self.replicas, 'replica')}"

    def loads(self, saved: Shape, sharded: bool) -> bool:
        """Whether a checkpoint of shape `saved` loads into this shape as it is; `sharded`: its optimizer
        state is partitioned over the replicas (ZeRO-1, or bf16's optimizer), not replicated."""
        same_bounds = saved.bounds is None or saved.bounds == self.bounds
        return saved.stages == self.stages and same_bounds and (saved.replicas == self.replicas or not sharded)

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "bounds": None if self.bounds is None else list(self.bounds)}


def engine_shape(engine: deepspeed.PipelineEngine) -> Shape:
    grid = engine.grid
    return Shape(
        grid.get_pipe_parallel_world_size(), grid.get_data_parallel_world_size(), tuple(stage_bounds(engine.module))
    )


def saved_shape(manifest: dict[str, Any]) -> Shape:
    """A committed checkpoint's shape: recorded, or for an older checkpoint read from its file names
    (one model-states file per stage, one optimizer file per stage and replica)."""
    if "shape" in manifest:
        shape = manifest["shape"]
        return Shape(shape["stages"], shape["replicas"], None if shape["bounds"] is None else tuple(shape["bounds"]))
    stages = sum(1 for name in manifest["files"] if STAGE_FILE.fullmatch(name))
    optimizer_files = sum(1 for name in manifest["files"] if OPTIMIZER_FILE.fullmatch(name))
    return Shape(stages, max(optimizer_files // max(stages, 1), 1))


def sharded(manifest: dict[str, Any]) -> bool:
    """Whether a checkpoint's optimizer state is partitioned over its replicas (else each stage's
    model-states file holds it whole)."""
    return any(OPTIMIZER_FILE.fullmatch(name) for name in manifest["files"])


def universal_tag(tag: str) -> str:
    return tag + UNIVERSAL


def manifest_files(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file under `directory` by its path there, with what the manifest checks."""
    return {
        path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "zip": zipfile.is_zipfile(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def converter_command(checkpoint: Path, out: Path) -> list[str]:
    """DeepSpeed's converter of `checkpoint` into its universal form in `out` (which it makes), with a
    worker per core up to 4; `--inject_missing_state` adds the universal_checkpoint_info that only
    Megatron-style clients save."""
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
            "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", workers,
            "--num_merge_workers", workers]  # fmt: skip


def convert(checkpoint: Path, manifest: dict[str, Any]) -> Path:
    """Writes the universal form of a committed checkpoint to CHECKPOINT.universal and commits it with
    a manifest; returns its path. Reuses one committed earlier. Global rank 0 only."""
    target = checkpoint.with_name(universal_tag(checkpoint.name))
    if (done := read_manifest(target)) is not None and not any(
        file_damage(target / name, entry, read=True) for name, entry in done["files"].items()
    ):
        return target
    shutil.rmtree(target, ignore_errors=True)  # a conversion a crash interrupted
    # The converter also writes `latest_universal` beside its output: both go in a scratch folder.
    scratch = unique_sibling(target)
    work = scratch / target.name
    try:
        scratch.mkdir()
        result = subprocess.run(converter_command(checkpoint, work), capture_output=True, text=True)
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).strip().splitlines() or ["no output"]
            raise ConfigError(
                f"--resume: DeepSpeed's ds_to_universal could not convert {checkpoint} ({lines[-1]}); "
                "resume on the shape it was saved in"
            )
        for name in manifest["files"]:
            if name.startswith("layer_"):  # the weights: DeepSpeed's pipeline loader reads them from the tag
                link_or_copy(checkpoint / name, work / name)
        universal = {**manifest, "tag": target.name, "source": checkpoint.name, "files": manifest_files(work)}
        write_atomic(work / MANIFEST, json.dumps(universal, indent=1, sort_keys=True) + "\n")
        os.replace(work, target)
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def link_or_copy(source: Path, target: Path) -> None:
    """The file at a second name: a hard link (no copy, and the original's bytes are never rewritten in
    place), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def remove_universal(save_dir: Path) -> None:
    """Deletes the universal copies of checkpoints, and what conversions a crash cut short left: once a run
    has committed a checkpoint in its new shape, they are no longer what a resume loads. Global rank 0 only."""
    for path in [*save_dir.glob(f"*{UNIVERSAL}"), *save_dir.glob(f".*{UNIVERSAL}.*.tmp")]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def prepare_reshape(
    engine: deepspeed.PipelineEngine, checkpoint: Path, manifest: dict[str, Any]
) -> tuple[str, str] | None:
    """(tag to load, what was reshaped) when this launch's shape cannot load `checkpoint` as it is,
    after rank 0 has converted it; None when it can. Every rank calls it."""
    saved, now = saved_shape(manifest), engine_shape(engine)
    if now.loads(saved, sharded(manifest)):
        return None
    outcome: list[str | float] = [0.0]
    if dist.get_rank() == 0:
        started = time.perf_counter()
        try:
            convert(checkpoint, manifest)
            outcome[0] = time.perf_counter() - started
        except (ConfigError, OSError) as err:
            outcome[0] = str(err)
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], str):
        raise ConfigError(outcome[0])
    bounds = f" (stage bounds {list(saved.bounds)} -> {list(now.bounds)})" if saved.stages == now.stages else ""
    took = f"converted to DeepSpeed's universal form in {outcome[0]:.1f} s"
    return universal_tag(checkpoint.name), f"{checkpoint.name} written as {saved} as {now}{bounds}; {took}"
