"""Resuming a run on another shape: another stage count, data-parallel size or partition.

A checkpoint's weights are one file per layer and load on any shape; its optimizer state does not:
ZeRO-1 keeps the fp32 master weights and Adam's moments as one flat partition per stage and
data-parallel rank. DeepSpeed's universal checkpoint stores them per parameter instead, which any shape
loads. On a --resume whose shape differs from the checkpoint's, global rank 0 converts the checkpoint
with DeepSpeed's own converter (`python -m deepspeed.checkpoint.ds_to_universal`) into TAG.universal
beside it, adds the layer files (DeepSpeed's pipeline loader reads the weights from there) and commits it
with a manifest, as training commits its checkpoints; every rank then loads it as a universal
checkpoint. The original is only read. The next checkpoint the run commits is in the new shape, and
the universal copy is removed then. Rank 0 converts only on a file system with the space the conversion
takes; a conversion that fails says why (a full disk, memory, a file it could not read) in one line and
leaves no part of the copy.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch.distributed as dist

from fathom.common.checkpoint_format import (
    OPTIMIZER_FILE,
    STAGE_FILE,
    file_damage,
    manifest_files,
    read_manifest,
    write_manifest,
)
from fathom.common.errors import ConfigError
from fathom.common.files import fsync_dir, unique_sibling
from fathom.common.run_layout import UNIVERSAL, universal_tag
from fathom.pipeline.engine.internals import built_stage_bounds


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
        grid.get_pipe_parallel_world_size(),
        grid.get_data_parallel_world_size(),
        tuple(built_stage_bounds(engine.module)),
    )


def saved_shape(manifest: dict[str, Any]) -> Shape:
    """A committed checkpoint's shape, as its manifest (read_manifest's) records it."""
    shape = manifest["shape"]
    return Shape(shape["stages"], shape["replicas"], None if shape["bounds"] is None else tuple(shape["bounds"]))


def sharded(manifest: dict[str, Any]) -> bool:
    """Whether a checkpoint's optimizer state is partitioned over its replicas (else each stage's
    model-states file holds it whole)."""
    return any(OPTIMIZER_FILE.fullmatch(name) for name in manifest["files"])


def converter_workers() -> int:
    """The processes the converter reads and merges with: one per core, up to 4."""
    return max(1, min(4, os.cpu_count() or 1))


def converter_command(checkpoint: Path, out: Path) -> list[str]:
    """DeepSpeed's converter of `checkpoint` into its universal form in `out` (which it makes), with
    converter_workers(); `--inject_missing_state` adds the universal_checkpoint_info that only
    Megatron-style clients save."""
    workers = str(converter_workers())
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
            "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", workers,
            "--num_merge_workers", workers]  # fmt: skip


# The disk a conversion takes at its peak. The converter first cuts the optimizer partitions into one
# fragment file per parameter tensor and state (fp32, exp_avg, exp_avg_sq, step) under tmp/, then merges
# them into zero/, and deletes tmp/ only after that: twice the optimizer state, plus per tensor eight
# small torch files (about 1.5 kB of zip records each, rounded up to 4 KiB blocks) and three folders.
# Measured with `du -sB1` on the 2-stage checkpoints tests/test_reshape.py trains (fp32 and bf16 alike:
# 85 tensors, 2.84 MB of optimizer files, 8.9 kB of model states), converted with --keep_temp_folder:
# tmp/ 4.86 MB and zero/ 4.51 MB, 9.39 MB in all, against 2 x 2.84 MB + 8.9 kB + 85 x 44 KiB = 9.53 MB.
# On tmpfs, which gives folders no blocks, the same conversion took 8.34 MB at its peak (df before and after).
# At 500L-500L (docs/BENCHMARKS.md: 231M parameters, 12 bytes each) the optimizer state dominates.
TENSOR_OVERHEAD = 44 * 1024
CONVERTER = "DeepSpeed's ds_to_universal"  # what the messages call it
# A write the disk refused: torch's zip writer reports it as a file position it did not reach, or a failed
# write, without the system's reason (common/files.py); the converter's folders and copies with the system's.
FULL_DISK = re.compile(r"unexpected pos \d+ vs \d+|file write failed|No space left on device|Disk quota exceeded")
OUT_OF_MEMORY = re.compile(r"\bMemoryError\b|DefaultCPUAllocator|Cannot allocate memory")
FILE_ERROR = re.compile(r"\[Errno (\d+)\] ([^:]+): '([^']+)'")  # an OSError that names its file
UNREADABLE = re.compile(r"UnpicklingError|PytorchStreamReader failed|EOFError")


def universal_bytes(checkpoint: Path, manifest: dict[str, Any]) -> int:
    """About the most disk space converting `checkpoint` takes at once (TENSOR_OVERHEAD). The layer files
    hold each parameter tensor as one record of their zip archive: counted, not loaded."""
    files = manifest["files"]
    optimizer = sum(entry["bytes"] for name, entry in files.items() if OPTIMIZER_FILE.fullmatch(name))
    states = sum(entry["bytes"] for name, entry in files.items() if STAGE_FILE.fullmatch(name))
    tensors = 0
    for name, entry in files.items():
        if name.startswith("layer_") and entry["zip"]:
            with zipfile.ZipFile(checkpoint / name) as archive:
                tensors += sum(1 for record in archive.namelist() if "/data/" in record)
    return 2 * optimizer + states + tensors * TENSOR_OVERHEAD


def mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def megabytes(size: float) -> str:
    return f"{size / 1e6:,.1f} MB" if size < 1e8 else f"{size / 1e6:,.0f} MB"


def check_space(checkpoint: Path, need: int) -> None:
    """Fails (as the system's ENOSPC, exit status 1) unless the checkpoint's file system has `need` bytes free."""
    if (free := shutil.disk_usage(checkpoint.parent).free) < need:
        raise OSError(
            errno.ENOSPC,
            f"no space left on {mount_point(checkpoint.parent)}: the universal copy of {checkpoint.name} needs about "
            f"{megabytes(need)}, {megabytes(free)} free; free space and run the same command again",
        )


def last_line(output: str) -> str:
    line = (output.strip().splitlines() or ["no output"])[-1].strip()
    return line if len(line) <= 200 else line[:197] + "..."


def converter_error(
    checkpoint: Path, manifest: dict[str, Any], need: int, result: subprocess.CompletedProcess
) -> OSError | ConfigError:
    """What a failed conversion says: a full disk, a lack of memory or an unreadable file named as such
    (OSError for what the system could not write or read), anything else with the converter's last line."""
    if result.returncode == -signal.SIGKILL:
        return out_of_memory(
            checkpoint, manifest, "was killed by SIGKILL, most likely by the kernel's out-of-memory killer"
        )
    if result.returncode < 0:
        return failure(checkpoint, manifest, f"ended by {signal_name(-result.returncode)}")
    output = result.stderr or result.stdout or ""
    last = last_line(output)
    if FULL_DISK.search(output):
        return write_failure(checkpoint, need, last)
    if "BrokenProcessPool" in output:  # a worker ended without an exception: killed
        return out_of_memory(
            checkpoint, manifest, "had a worker killed, most likely by the kernel's out-of-memory killer"
        )
    if OUT_OF_MEMORY.search(output):
        return out_of_memory(checkpoint, manifest, "ran out of memory")
    if named := FILE_ERROR.search(last):
        return OSError(
            int(named[1]),
            f"{named[2]} ({CONVERTER}, converting {checkpoint.name} for the new shape); make the file readable or "
            "restore it, and run the same command again",
            named[3],
        )
    if UNREADABLE.search(last):
        return ConfigError(
            f"--resume: {CONVERTER} could not read a file of {checkpoint} ({last}); it passed its checksums, so it "
            f"changed since or DeepSpeed cannot read it: restore it from a copy, or resume on the shape it was saved "
            f"in ({saved_shape(manifest)})"
        )
    return failure(checkpoint, manifest, last)


def write_failure(checkpoint: Path, need: int, last: str) -> OSError:
    """The converter could not write (its `last` line): a full disk, unless the space is there now."""
    free, where = shutil.disk_usage(checkpoint.parent).free, mount_point(checkpoint.parent)
    if free < need:
        return OSError(
            errno.ENOSPC,
            f"no space left on {where}: {CONVERTER} could not write the universal copy of {checkpoint.name} ({last}); "
            f"it needs about {megabytes(need)}, {megabytes(free)} free; free space and run the same command again",
        )
    return OSError(
        errno.ENOSPC,
        f"{CONVERTER} could not write the universal copy of {checkpoint.name} on {where} ({last}), which needs about "
        f"{megabytes(need)} with {megabytes(free)} free now: a disk quota, a file size limit (ulimit -f) or another "
        "writer filling the disk; lift it or free space and run the same command again",
    )


def failure(checkpoint: Path, manifest: dict[str, Any], what: str) -> ConfigError:
    """A conversion that failed for a reason fathom does not know: the shape it was saved in needs none."""
    return ConfigError(
        f"--resume: {CONVERTER} could not convert {checkpoint} ({what}); resume on the shape it was saved in "
        f"({saved_shape(manifest)}), which needs no conversion"
    )


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal
        return f"signal {number}"


def out_of_memory(checkpoint: Path, manifest: dict[str, Any], what: str) -> ConfigError:
    """`what` happened to the converter; each of its workers holds one optimizer file at a time."""
    workers = converter_workers()
    sizes = sorted((e["bytes"] for n, e in manifest["files"].items() if OPTIMIZER_FILE.fullmatch(n)), reverse=True)
    return ConfigError(
        f"--resume: {CONVERTER} {what}, while converting {checkpoint.name} for the new shape; its "
        f"{workers} workers read up to about {megabytes(sum(sizes[:workers]))} of optimizer state at once: free "
        "memory and run the same command again"
    )


def reusable(target: Path) -> bool:
    """Whether `target` is a universal copy committed earlier whose files are all whole."""
    done = read_manifest(target)
    return done is not None and not any(
        file_damage(target / name, entry, read=True) for name, entry in done["files"].items()
    )


def convert(checkpoint: Path, manifest: dict[str, Any]) -> bool:
    """Writes the universal form of a committed checkpoint to CHECKPOINT.universal and commits it with
    a manifest; False when it reuses one committed earlier. Global rank 0 only. A failure leaves no part
    of it."""
    target = checkpoint.with_name(universal_tag(checkpoint.name))
    if reusable(target):
        return False
    # What a conversion a crash interrupted left, before its space is counted free
    for partial in (target, *target.parent.glob(f".{target.name}.*.tmp")):
        shutil.rmtree(partial, ignore_errors=True)
    need = universal_bytes(checkpoint, manifest)
    check_space(checkpoint, need)
    # The converter also writes `latest_universal` beside its output: both go in a scratch folder.
    scratch = unique_sibling(target)
    try:
        scratch.mkdir()
        result = subprocess.run(converter_command(checkpoint, scratch / target.name), capture_output=True, text=True)
        if result.returncode == 0:
            commit(checkpoint, manifest, scratch / target.name, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if result.returncode != 0:  # told after the scratch is gone, so that the free space it reports is there
        raise converter_error(checkpoint, manifest, need, result)
    return True


def commit(checkpoint: Path, manifest: dict[str, Any], work: Path, target: Path) -> None:
    """Adds the layer files and a manifest to the converter's output `work`, and renames it `target`."""
    for name in manifest["files"]:
        if name.startswith("layer_"):  # the weights: DeepSpeed's pipeline loader reads them from the tag
            link_or_copy(checkpoint / name, work / name)
    write_manifest(work, {**manifest, "tag": target.name, "source": checkpoint.name, "files": manifest_files(work)})
    os.replace(work, target)
    fsync_dir(target.parent)


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
    # rank 0's seconds converting (None: it reused a copy), or what stopped it, raised on every rank as it is:
    # an OSError ends the job with exit status 1, a ConfigError with 2
    outcome: list[float | Exception | None] = [None]
    if dist.get_rank() == 0:
        started = time.perf_counter()
        try:
            converted = convert(checkpoint, manifest)
            outcome[0] = time.perf_counter() - started if converted else None
        except (ConfigError, OSError) as err:
            outcome[0] = err
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    bounds = f" (stage bounds {list(saved.bounds)} -> {list(now.bounds)})" if saved.stages == now.stages else ""
    if outcome[0] is None:
        how = f"reused its universal form, converted by an earlier resume ({universal_tag(checkpoint.name)})"
    else:
        how = f"converted to DeepSpeed's universal form in {outcome[0]:.1f} s"
    return universal_tag(checkpoint.name), f"{checkpoint.name} written as {saved} as {now}{bounds}; {how}"
