"""What a checkpoint holds, every key of it, and how a checkpoint of an older fathom is read as today's.

A checkpoint is one tag directory of a run (common/run_layout.py names the tags and the run's records):

- `layer_NN-model_states.pt`, one per layer with parameters, named by the layer's index in the spec
  list (tied re-uses have none); model.parts.saved_names says which module of the single-process model
  each belongs to. Plain tensors: reading them needs no DeepSpeed (translation and export).
- `mp_rank_SS_model_states.pt` (STAGE_FILE), one per pipeline stage: DeepSpeed's counters (`global_steps`,
  `skipped_steps`, `dp_world_size`, `ds_config`, ...) and fathom's client state, `client_state`'s keys.
- `[bf16_]zero_pp_rank_R_mp_rank_SS_optim_states.pt` (OPTIMIZER_FILE), one per stage and data-parallel
  replica when the optimizer state is partitioned (ZeRO-1, bf16); without them each stage file holds it.
- `fathom_manifest.json` (MANIFEST): written last, it commits the checkpoint (pipeline/checkpoint/
  saving.py), and records what the files cannot say: new_manifest's keys.

FORMAT is the manifest's version. Every reader goes through read_manifest, which checks the type of
every key (parse_manifest: a damaged manifest is one line naming it) and brings an older manifest up to
FORMAT (upgrade_manifest, as fairseq's upgrade_state_dict does for its checkpoints), so no reader asks
which fathom wrote a checkpoint, or finds a key missing or of another type:

- 1: a manifest with no `format` key; `schedule_step` and `shape` came later and may be missing.
- 2: `format`, and every key of new_manifest; averaged checkpoints have a manifest too.

A checkpoint with no manifest at all was written before fathom committed checkpoints, by DeepSpeed
alone, or converted from fairseq: unversioned_schedule_step reads what such a one has.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fathom.common.errors import ConfigError
from fathom.common.files import write_atomic

FORMAT = 2
MANIFEST = "fathom_manifest.json"
MODEL_STATES = "mp_rank_00_model_states.pt"  # the first stage's (DeepSpeed's counters are on every stage's)
STAGE_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
OPTIMIZER_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt")  # layer_file's names

# fathom's keys in DeepSpeed's client state, on every stage's STAGE_FILE (ClientState's).
DATA_POSITION = "data_position"
SCHEDULE_OFFSET = "schedule_offset"
BEST_VALUE = "best_valid_{metric}"
LOSS_PER_TOKEN = "valid_loss_per_token"


@dataclass(frozen=True)
class ClientState:
    """What every checkpoint keeps beside DeepSpeed's own state, one record for its writer (the training
    loop) and its readers, read through `read` alone: a key an older checkpoint lacks has its meaning there."""

    # the best validation value so far by metric (pipeline/validation.py); {} before any validation
    best: dict[str, float] = field(default_factory=dict)
    # the step train.init_from's weights started at (pipeline/train.py); 0 for a run from scratch
    schedule_offset: int = 0
    # micro-batches read and their order (pipeline/checkpoint/data_position.py); None: written before
    # positions were recorded, which saved_position reconstructs from the run's config
    data_position: dict[str, Any] | None = None
    # a best loss is per target token; False: a fathom before that saved the mean of micro-batch means
    loss_per_token: bool = True

    def to_dict(self) -> dict[str, Any]:
        best = {BEST_VALUE.format(metric=metric): value for metric, value in self.best.items()}
        return {**best, LOSS_PER_TOKEN: self.loss_per_token, SCHEDULE_OFFSET: self.schedule_offset,
                DATA_POSITION: self.data_position}  # fmt: skip

    @classmethod
    def read(cls, states: Mapping[str, Any]) -> ClientState:
        """The client state in a checkpoint's model states (DeepSpeed's client state, or a whole stage file),
        from any fathom's checkpoint: a key it lacks means what an older fathom did."""
        prefix = BEST_VALUE.format(metric="")
        best = {key.removeprefix(prefix): value for key, value in states.items() if key.startswith(prefix)}
        return cls(best, int(states.get(SCHEDULE_OFFSET, 0)), states.get(DATA_POSITION),
                   bool(states.get(LOSS_PER_TOKEN, False)))  # fmt: skip


def new_manifest(
    tag: str,
    step: int,
    schedule_step: int,
    files: dict[str, dict[str, Any]],
    shape: dict[str, Any] | None,
    world_size: int | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """A manifest of FORMAT: `step`, the optimizer steps taken (global_steps); `schedule_step`, the step
    the step-dependent values (BranchNorm's alpha_t) belong to: updates applied plus the step
    train.init_from's weights started at; `files`, {name: {"bytes", "zip"}} of every file; `shape`,
    {"stages", "replicas", "bounds"} of the pipeline that wrote it (None: not resumable, an average);
    `source`, the tag a universal copy was converted from."""
    manifest = {"format": FORMAT, "tag": tag, "step": step, "schedule_step": schedule_step, "files": files,
                "shape": shape, "world_size": world_size}  # fmt: skip
    return manifest if source is None else {**manifest, "source": source}


def file_entry(path: Path) -> dict[str, Any]:
    """What a manifest records of one file, for file_damage to check."""
    return {"bytes": path.stat().st_size, "zip": zipfile.is_zipfile(path)}


def manifest_files(directory: Path) -> dict[str, dict[str, Any]]:
    """file_entry of every file under `directory`, by its path there."""
    return {
        path.relative_to(directory).as_posix(): file_entry(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def is_checkpoint(folder: Path) -> bool:
    """Whether `folder` is a checkpoint tag: fathom's (a manifest) or DeepSpeed's (a stage file)."""
    return (folder / MANIFEST).exists() or (folder / MODEL_STATES).exists()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def read_manifest(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest in FORMAT; None for one that has none (see the module's docstring)."""
    path = checkpoint / MANIFEST
    return upgrade_manifest(parse_manifest(path), checkpoint) if path.exists() else None


def _is_count(value: Any, least: int = 0) -> bool:
    """A JSON integer from `least` on (not true or false, which Python takes for 1 and 0)."""
    return type(value) is int and value >= least


def _is_bounds(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(_is_count(bound) for bound in value))


def _is_shape(value: Any) -> bool:
    if value is None:  # an average: not resumable
        return True
    return (
        isinstance(value, dict)
        and _is_count(value.get("stages"), 1)
        and _is_count(value.get("replicas"), 1)
        and "bounds" in value
        and _is_bounds(value["bounds"])
    )


def _is_file_entry(value: Any) -> bool:
    return isinstance(value, dict) and _is_count(value.get("bytes")) and type(value.get("zip")) is bool


# Every key a manifest may hold: whether a value is one, and what it must be. FORMAT's have them all but
# `source` (a universal copy's); the first format always had `step` and `files`.
MANIFEST_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (lambda value: _is_count(value, 1), "a format number (an integer from 1)"),
    "tag": (lambda value: isinstance(value, str), "a tag"),
    "step": (_is_count, "a step count (an integer from 0)"),
    "schedule_step": (_is_count, "a step count (an integer from 0)"),
    "files": (lambda value: isinstance(value, dict), '{file name: {"bytes", "zip"}}'),
    "shape": (_is_shape, '{"stages", "replicas", "bounds"} or null'),
    "world_size": (lambda value: value is None or _is_count(value, 1), "a process count or null"),
    "source": (lambda value: isinstance(value, str), "a tag"),
}
REQUIRED_KEYS = {1: ("step", "files"), FORMAT: tuple(key for key in MANIFEST_KEYS if key != "source")}
FILE_ENTRY = '{"bytes": an integer from 0, "zip": true or false}'


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _manifest_problem(manifest: Any) -> str | None:
    """What makes a manifest (as json.loads read it, of FORMAT or older) unreadable, or None."""
    if not isinstance(manifest, dict):
        return f"not a JSON object but {_shown(manifest)}"
    for key, (is_valid, what) in MANIFEST_KEYS.items():
        if key in manifest and not is_valid(manifest[key]):
            return f"'{key}' is {_shown(manifest[key])}, not {what}"
    if missing := [key for key in REQUIRED_KEYS.get(manifest.get("format", 1), ()) if key not in manifest]:
        return f"no '{missing[0]}'"
    if bad := next((name for name, entry in manifest["files"].items() if not _is_file_entry(entry)), None):
        return f"'files' has {bad}: {_shown(manifest['files'][bad])}, not {FILE_ENTRY}"
    return None


def parse_manifest(path: Path) -> dict[str, Any]:
    """The manifest at `path` as written, every key of the type the readers take it for; a damaged one
    (cut short, edited, overwritten) or one of a newer fathom fails in one line naming it."""
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        problem = f"not text (byte {err.object[err.start]:#04x} at {err.start} is not UTF-8)"
    except json.JSONDecodeError as err:
        problem = f"not JSON ({'empty' if not err.doc.strip() else err})"
    else:
        version = manifest.get("format", 1) if isinstance(manifest, dict) else 1
        if _is_count(version, FORMAT + 1):
            raise ConfigError(
                f"{path}: checkpoint format {version}, written by a newer fathom than this one (format {FORMAT}); "
                "update fathom to read it"
            )
        if (problem := _manifest_problem(manifest)) is None:
            return manifest
    raise ConfigError(
        f"{path}: {problem}; the manifest is damaged: restore it from a copy of the run, or use another of its "
        "checkpoints"
    )


def upgrade_manifest(manifest: dict[str, Any], checkpoint: Path) -> dict[str, Any]:
    """`manifest`, read from `checkpoint` (parse_manifest's), in FORMAT. A first-format manifest without
    a schedule step costs a read of the checkpoint's MODEL_STATES file, every time it is read: such
    checkpoints are only those of a fathom from before schedule steps were recorded."""
    if manifest.get("format", 1) == 1:
        manifest = {**manifest, "format": FORMAT}
        if "schedule_step" not in manifest:  # then every update moved the schedules, none was skipped
            states = model_states(checkpoint)
            manifest["schedule_step"] = manifest["step"] - (states or {}).get("skipped_steps", 0)
        if "shape" not in manifest:  # one stage file per stage, one optimizer file per stage and replica
            stages = sum(1 for name in manifest["files"] if STAGE_FILE.fullmatch(name))
            optimizer_files = sum(1 for name in manifest["files"] if OPTIMIZER_FILE.fullmatch(name))
            manifest["shape"] = {"stages": stages, "replicas": max(optimizer_files // max(stages, 1), 1),
                                 "bounds": None}  # fmt: skip
    return manifest


def unversioned_schedule_step(checkpoint: Path) -> int:
    """The schedule step of a checkpoint without a manifest: recorded by an older fathom's average, else
    the updates DeepSpeed counted; 0 for weights without counters (converted from fairseq)."""
    states = model_states(checkpoint)
    if states is None:
        return 0
    return int(states.get("schedule_step", states["global_steps"] - states.get("skipped_steps", 0)))


def schedule_step(checkpoint: Path) -> int:
    """The step a checkpoint's step-dependent values (BranchNorm's alpha_t) belong to."""
    manifest = read_manifest(checkpoint)
    return unversioned_schedule_step(checkpoint) if manifest is None else int(manifest["schedule_step"])


def global_step(checkpoint: Path) -> int:
    """The optimizer steps a checkpoint had taken (weights converted from fairseq: step 0)."""
    manifest = read_manifest(checkpoint)
    if manifest is not None:
        return int(manifest["step"])
    states = model_states(checkpoint)
    return 0 if states is None else int(states["global_steps"])


def layer_file(checkpoint: Path, index: int) -> Path:
    return checkpoint / f"layer_{index:02d}-model_states.pt"


def layer_files(checkpoint: Path) -> list[Path]:
    """Every layer file a checkpoint holds, whatever its model."""
    return sorted(path for path in checkpoint.iterdir() if LAYER_FILE.fullmatch(path.name))


def model_states(checkpoint: Path) -> dict[str, Any] | None:
    """DeepSpeed's first stage file of a checkpoint (its counters, fathom's client state), None if absent."""
    path = checkpoint / MODEL_STATES
    if not path.exists():
        return None
    try:
        return load_file(path)
    except ConfigError:  # it names DeepSpeed's classes (ZeRO 0's optimizer state, fp16's loss scaler)
        return load_file(path, allowed=deepspeed_state_types())


def deepspeed_state_types() -> list[type]:
    """The non-tensor objects DeepSpeed pickles into model and ZeRO optimizer states (found with
    torch.serialization.get_unsafe_globals_in_checkpoint); plain data, no code runs when they load.
    fp16 runs (GPU only) save DynamicLossScaler where the others save LossScaler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


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
    # The manifest as written: upgrading one reads DeepSpeed's counters with this function.
    committed = path.parent / MANIFEST
    files = parse_manifest(committed)["files"] if verify and committed.exists() else {}
    if path.name in files and (problem := file_damage(path, files[path.name], read=True)):
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
