"""The layout of a run directory (train.save_dir) and of its checkpoints, owned here and nowhere else:
the names of everything a run keeps, the tags (`global_stepN`, `best_global_stepN`, `avg_*`), `latest`
and `best`, the manifest that commits a checkpoint, and which tags are committed. Saving
(pipeline/checkpoint/saving.py), resuming, averaging and reading all go through it.

A pipeline checkpoint holds one file per layer with parameters, named by the layer's index in the spec
list (layer_07-..., layer_123-...; tied re-uses have none); model.parts.saved_names says which module
of the single-process model each file belongs to. Reading needs no DeepSpeed (translation and export
run without it); only DeepSpeed's own state files name its classes.
"""

from __future__ import annotations

import fnmatch
import json
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from common.errors import ConfigError

# What a run keeps in SAVE_DIR beside its checkpoint tags, named here for every module that writes one.
CONFIG_FILE = "config.json"  # the config of the latest launch
CONFIG_HISTORY = "config_history.jsonl"  # each stretch's config (pipeline/config/history.py)
LATEST = "latest"  # DeepSpeed's name for the file naming the newest checkpoint's tag
BEST = "best"  # the link to the checkpoint that scored best on validation
# The run's dictionaries by content: a data directory with the same vocabulary sizes but other
# dictionaries would train or translate garbage without an error.
DICTIONARIES_FILE = "dictionaries.json"
METRICS_FILE = "metrics.jsonl"
GRAD_NORMS_FILE = "grad_norms.jsonl"  # per-layer gradient norms (train.grad_norm_interval)
TRANSLATIONS = "translations"  # the validation set's translations at each validation with train.valid_bleu
TIME_BREAKDOWN_FILE = "time_breakdown.jsonl"  # train.time_breakdown
MEMORY_FILE = "memory.json"  # each stage's peak memory
HEARTBEAT_FILE = "heartbeat-rank{rank}.json"  # the hang watchdog's (pipeline/safety/watchdog.py)
LOCK_FILE = ".fathom.lock"  # held by the run training in SAVE_DIR (pipeline/checkpoint/run_directory.py)
PROFILE_FILE = "admin_profile.json"  # Admin's omegas, profiled at the run's start (pipeline/admin_profile.py)
# Names tools write into a run by default: generate.py's hypotheses, plot_metrics.py's image.
TOOL_OUTPUTS = ("generate-*.txt", "loss.png")
RUN_RECORDS = (CONFIG_FILE, CONFIG_HISTORY, LATEST, BEST, DICTIONARIES_FILE, METRICS_FILE, GRAD_NORMS_FILE,
               TRANSLATIONS, TIME_BREAKDOWN_FILE, MEMORY_FILE, HEARTBEAT_FILE.format(rank="*"), LOCK_FILE,
               PROFILE_FILE, *TOOL_OUTPUTS)  # fmt: skip

# Inside a checkpoint tag
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's: the module's and the engine's counters
MANIFEST = "fathom_manifest.json"  # a committed checkpoint's files and step (pipeline/checkpoint/saving.py)
STEP_TAG = re.compile(r"global_step(\d+)")  # DeepSpeed's default tag, which training keeps
TRAINING_TAG = re.compile(rf"(?:{BEST}_)?{STEP_TAG.pattern}")  # what training names its checkpoints

# A prepared data directory's last-written file: its presence means the directory is complete.
META_FILE = "meta.json"


def step_tag(step: int) -> str:
    """The tag of the checkpoint saved after `step` optimizer steps (DeepSpeed's own default)."""
    return f"global_step{step}"


def best_tag(step: int) -> str:
    """The directory a best checkpoint is written to; the `best` link names the newest committed one."""
    return f"{BEST}_{step_tag(step)}"


def run_record(name: str) -> bool:
    """Whether `name` is, or matches, one a run keeps in SAVE_DIR beside its checkpoints."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_RECORDS)


def reserved_name(name: str) -> bool:
    """Whether training may write `name` into SAVE_DIR: a record, or a tag it names its checkpoints by
    (any global_step* or best_global_step* name, finished or not)."""
    return run_record(name) or name.startswith((step_tag(""), best_tag("")))


def deepspeed_state_types() -> list[type]:
    """The non-tensor objects DeepSpeed pickles into model and ZeRO optimizer states (found with
    torch.serialization.get_unsafe_globals_in_checkpoint); plain data, no code runs when they load.
    fp16 runs (GPU only) save DynamicLossScaler where the others save LossScaler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def latest_tag(save_dir: str | Path) -> str | None:
    """The tag `latest` names: the newest complete checkpoint, a global_stepN or a best_global_stepN
    (pipeline/checkpoint/saving.py moves it on every save)."""
    path = Path(save_dir) / LATEST
    return path.read_text().strip() if path.exists() else None


def linked_best(save_dir: str | Path) -> str | None:
    """The tag the `best` link names: the checkpoint that scored best on validation."""
    path = Path(save_dir) / BEST
    return Path(os.readlink(path)).name if path.is_symlink() else None


def tag_step(tag: str) -> int | None:
    """N of a training checkpoint's tag (global_stepN, best_global_stepN); None for other tags."""
    match = TRAINING_TAG.fullmatch(tag)
    return int(match[1]) if match else None


def latest_step(save_dir: str | Path) -> int:
    """The step of the checkpoint `latest` names; -1 without one (or for a tag not named by a step)."""
    step = tag_step(latest_tag(save_dir) or "")
    return -1 if step is None else step


def has_checkpoints(save_dir: str | Path) -> bool:
    """Whether a run saved any checkpoint into save_dir: `latest`, `best`, or a committed tag (with a
    manifest) that a crash kept either from naming."""
    save_dir = Path(save_dir)
    return (
        (save_dir / LATEST).exists()
        or linked_best(save_dir) is not None
        or any(save_dir.glob(f"*global_step*/{MANIFEST}"))
    )


def plain_name(tag: str) -> bool:
    """Whether `tag` names a visible folder directly inside SAVE_DIR."""
    return bool(tag) and Path(tag).name == tag and not tag.startswith(".")


def checkpoint_dir(save_dir: str | Path, tag: str | None = None) -> Path:
    save_dir = Path(save_dir)
    if tag is None:
        tag = latest_tag(save_dir)
        if tag is None:
            raise ConfigError(f"{save_dir}: no '{LATEST}' file; pass a tag (one of the global_step* folders)")
        if not plain_name(tag):
            raise ConfigError(f"{save_dir / LATEST}: names '{tag}', not a tag; pass --tag (a global_step* folder)")
    elif not plain_name(tag):
        raise ConfigError(f"--tag: '{tag}' is not a tag; pass a folder name inside {save_dir}, e.g. best")
    path = save_dir / tag
    if not path.is_dir():
        raise ConfigError(f"{save_dir}: no checkpoint tagged '{tag}'")
    return path


def read_manifest(checkpoint: Path) -> dict[str, Any] | None:
    """None for a checkpoint written before fathom committed checkpoints (or by plain DeepSpeed)."""
    path = checkpoint / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def file_damage(path: Path, entry: dict[str, Any], read: bool) -> str | None:
    """What is wrong with one file of a committed checkpoint, or None; `read` also checks every byte
    against the zip archive's CRC-32s (torch's format), which reads the whole file."""
    if not path.exists():
        return f"{path}: missing; restore the file or start a new run"
    if path.stat().st_size != entry["bytes"]:
        return (
            f"{path}: {path.stat().st_size} bytes, but {entry['bytes']} when it was saved; the file is truncated "
            "or damaged: restore it or start a new run"
        )
    if read and entry["zip"]:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except zipfile.BadZipFile:
            bad = "the archive"
        if bad is not None:
            return f"{path}: {bad} fails its checksum; the file is damaged: restore it or start a new run"
    return None


def load_file(path: str | Path, map_location: Any = "cpu", allowed: list[type] = (), verify: bool = True) -> Any:
    """torch.load that cannot run code (weights_only; `allowed` names the plain-data classes a format
    needs), with a one-line error for a file that is unreadable or would need arbitrary unpickling. A
    file of a committed checkpoint is first checked against its manifest (unless the caller has
    `verify`-ed it already): torch.load reads flipped bytes in a tensor without complaint."""
    path = Path(path)
    manifest = read_manifest(path.parent) if verify else None
    if manifest is not None and path.name in manifest["files"]:
        if problem := file_damage(path, manifest["files"][path.name], read=True):
            raise ConfigError(problem)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "GLOBAL " not in str(err):  # not a refused class: garbage where a pickle should be
            raise ConfigError(f"{path}: unreadable ({err}); the file is damaged or not a checkpoint") from None
        name = str(err).partition("GLOBAL ")[2].split(" ", 1)[0]
        raise ConfigError(
            f"{path}: holds {name}, which fathom does not unpickle (it could run code); "
            "load only checkpoints written by fathom or DeepSpeed"
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{path}: unreadable ({first}); the file is truncated or not a checkpoint") from None


def layer_file(checkpoint: Path, index: int) -> Path:
    return checkpoint / f"layer_{index:02d}-model_states.pt"


def model_states(checkpoint: Path) -> dict[str, Any] | None:
    """DeepSpeed's mp_rank_00_model_states.pt of a checkpoint (its step counters), None if absent."""
    path = checkpoint / MODEL_STATES
    if not path.exists():
        return None
    try:
        return load_file(path)
    except ConfigError:  # it names DeepSpeed's classes (ZeRO 0's optimizer state, fp16's loss scaler)
        return load_file(path, allowed=deepspeed_state_types())


def global_step(checkpoint: Path) -> int:
    """The optimizer steps a checkpoint had taken: from fathom's manifest, else from DeepSpeed's
    model-states file (weights converted from fairseq have neither: step 0)."""
    if (checkpoint / MANIFEST).exists():
        return int(json.loads((checkpoint / MANIFEST).read_text())["step"])
    states = model_states(checkpoint)
    return 0 if states is None else int(states["global_steps"])


def schedule_step(checkpoint: Path) -> int:
    """The step a checkpoint's step-dependent values (BranchNorm's alpha_t) belong to: the updates its
    run applied (steps skipped as non-finite do not count) plus the step train.init_from's weights
    started at. Checkpoints from before fathom recorded it: global steps less skipped ones."""
    manifest = read_manifest(checkpoint)
    if manifest is not None and "schedule_step" in manifest:
        return int(manifest["schedule_step"])
    states = model_states(checkpoint)
    if states is None:
        return 0 if manifest is None else int(manifest["step"])
    return int(states.get("schedule_step", states["global_steps"] - states.get("skipped_steps", 0)))


def is_run(folder: Path) -> bool:
    """Whether `folder` is a training run's SAVE_DIR."""
    return (folder / CONFIG_FILE).exists() and (folder / LATEST).exists()


def committed(checkpoint: Path, latest: int) -> bool:
    """Whether a checkpoint is a finished save: any tag but a global_stepN is (averages, conversions and
    best ones are staged whole); a global_stepN is once it has a manifest, or (runs from before manifests)
    when its step is not past `latest`'s, which a save moves last."""
    match = STEP_TAG.fullmatch(checkpoint.name)
    return match is None or read_manifest(checkpoint) is not None or int(match[1]) <= latest


def committed_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """(N, directory) of the committed global_stepN checkpoints, by N."""
    latest = latest_step(save_dir)
    return sorted(
        (int(match[1]), path)
        for path in save_dir.iterdir()
        if (match := STEP_TAG.fullmatch(path.name)) and path.is_dir() and not path.is_symlink()
        if committed(path, latest)
    )


def leftovers(save_dir: Path) -> list[Path]:
    """What crashed saves left: global_stepN tags that are not committed, and best checkpoints that
    neither `best` nor `latest` names any more."""
    kept, latest = {latest_tag(save_dir), linked_best(save_dir)}, latest_step(save_dir)
    return [
        path
        for path in sorted(save_dir.glob("*global_step*"))
        if path.is_dir() and not path.is_symlink() and tag_step(path.name) is not None and path.name not in kept
        if path.name.startswith(f"{BEST}_") or not committed(path, latest)
    ]
