"""The layout of a run directory (train.save_dir), owned here and nowhere else: the names of everything
a run keeps, the tags of its checkpoints (`global_stepN`, `best_global_stepN`, `avg_*`), `latest` and
`best`, and which tags are committed. Saving (pipeline/checkpoint/saving.py), resuming, averaging and
reading all go through it; what a checkpoint holds inside its tag is common/checkpoint_format.py's.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

from fathom.common.checkpoint_format import MANIFEST, is_checkpoint
from fathom.common.errors import ConfigError

# What a run keeps in SAVE_DIR beside its checkpoint tags, named here for every module that writes one.
CONFIG_FILE = "config.json"  # the config of the latest launch
CONFIG_HISTORY = "config_history.jsonl"  # each stretch's config (pipeline/config/history.py)
# The DeepSpeed config the engine received at the latest launch: config.json's DeepSpeed keys with fathom's
# engine defaults (pipeline/config/engine_defaults.py) where it leaves them out.
DEEPSPEED_CONFIG_FILE = "deepspeed_config.json"
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
PROFILE_FILE = "admin_profile.json"  # Admin's omegas, profiled at the run's start (pipeline/engine/admin_profile.py)
# DeepSpeed copies its recovery scripts into SAVE_DIR with each checkpoint of a ZeRO or bf16 run.
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
# What scripts/average_checkpoints.py writes into the tag it makes, and what scripts/convert_from_fairseq.py
# writes into the run directory it makes: each marks a directory that command's --force may replace.
AVERAGE_SUMMARY = "fathom_average.json"
IMPORT_SUMMARY = "fathom_import.json"
UNIVERSAL = ".universal"  # suffix of a checkpoint tag's universal form (pipeline/checkpoint/reshape.py)
# Names tools write into a run by default: generate.py's hypotheses, plot_metrics.py's image.
LOSS_PLOT = "loss.png"
TOOL_OUTPUTS = ("generate-*.txt", LOSS_PLOT)
RUN_RECORDS = (CONFIG_FILE, CONFIG_HISTORY, DEEPSPEED_CONFIG_FILE, LATEST, BEST, DICTIONARIES_FILE, METRICS_FILE,
               GRAD_NORMS_FILE, TRANSLATIONS, TIME_BREAKDOWN_FILE, MEMORY_FILE, HEARTBEAT_FILE.format(rank="*"),
               LOCK_FILE,
               PROFILE_FILE, *DEEPSPEED_SCRIPTS, *TOOL_OUTPUTS)  # fmt: skip

STEP_TAG = re.compile(r"global_step(\d+)")  # DeepSpeed's default tag, which training keeps
TRAINING_TAG = re.compile(rf"(?:{BEST}_)?{STEP_TAG.pattern}")  # what training names its checkpoints

# A prepared data directory's last-written file: its presence means the directory is complete.
META_FILE = "meta.json"


def translations_file(step: int) -> str:
    """The validation set's translations at `step`, in TRANSLATIONS."""
    return f"valid-step{step}.txt"


def step_tag(step: int) -> str:
    """The tag of the checkpoint saved after `step` optimizer steps (DeepSpeed's own default)."""
    return f"global_step{step}"


def best_tag(step: int) -> str:
    """The directory a best checkpoint is written to; the `best` link names the newest committed one."""
    return f"{BEST}_{step_tag(step)}"


def average_tag(tags: list[str], last: int | None) -> str:
    """The tag averaging writes by default: avg_lastK for the last K, else avg_ and the averaged training
    tags' steps, oldest first (avg_1800_2000)."""
    if last is not None:
        return f"avg_last{last}"
    return "avg_" + "_".join(tag.replace(step_tag(""), "") for tag in tags)


def universal_tag(tag: str) -> str:
    """The tag of checkpoint `tag`'s universal form, which a resume on another shape loads."""
    return tag + UNIVERSAL


def run_record(name: str) -> bool:
    """Whether `name` is, or matches, one a run keeps in SAVE_DIR beside its checkpoints."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_RECORDS)


def reserved_name(name: str) -> bool:
    """Whether training may write `name` into SAVE_DIR: a record, or a tag it names its checkpoints by
    (any global_step* or best_global_step* name, finished or not)."""
    return run_record(name) or name.startswith((step_tag(""), best_tag("")))


def latest_tag(save_dir: str | Path) -> str | None:
    """The tag `latest` names: the newest complete checkpoint, a global_stepN or a best_global_stepN
    (pipeline/checkpoint/saving.py moves it on every save); None without a `latest`. One that names no
    folder of SAVE_DIR fails in one line: not text, a path, or empty (DeepSpeed's own write of it cut
    off, in a run from before fathom committed checkpoints)."""
    path = Path(save_dir) / LATEST
    if not path.exists():
        return None
    try:
        tag = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise _damaged_latest(path, f"not text (byte {err.object[err.start]:#04x} is not UTF-8)") from None
    if not tag:
        raise _damaged_latest(path, "empty")
    if not is_folder_name(tag):
        raise _damaged_latest(path, f"names '{tag}', not a tag")
    return tag


def _damaged_latest(path: Path, problem: str) -> ConfigError:
    if newest := _newest_committed(path.parent):
        return ConfigError(f"{path}: {problem}; write the tag to go on from into it (the newest committed checkpoint: "
                           f"{newest})")  # fmt: skip
    return ConfigError(f"{path}: {problem}; the run has no committed checkpoint: remove it, or write into it the tag "
                       "of a checkpoint to go on from")  # fmt: skip


def _newest_committed(save_dir: Path) -> str | None:
    """The tag of the newest checkpoint training committed, found without `latest`."""
    tags = committed_tags(save_dir)
    return tags[-1] if tags else None


def committed_tags(save_dir: str | Path) -> list[str]:
    """The tags of the checkpoints training committed (global_stepN or best_global_stepN, with a manifest),
    in step order."""
    found = [(step, path.parent.name) for path in Path(save_dir).glob(f"*global_step*/{MANIFEST}")
             if (step := tag_step(path.parent.name)) is not None]  # fmt: skip
    return [tag for _, tag in sorted(found)]


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


def is_folder_name(tag: str) -> bool:
    """Whether `tag` names a visible folder directly inside SAVE_DIR."""
    return bool(tag) and Path(tag).name == tag and not tag.startswith(".")


def checkpoint_dir(save_dir: str | Path, tag: str | None = None) -> Path:
    save_dir = Path(save_dir)
    if tag is None:
        tag = latest_tag(save_dir)
        if tag is None:
            raise ConfigError(_no_latest(save_dir))
    elif not is_folder_name(tag):
        raise ConfigError(f"--tag: '{tag}' is not a tag; pass a folder name inside {save_dir}, e.g. best")
    path = save_dir / tag
    if not path.is_dir():
        raise ConfigError(f"{save_dir}: no checkpoint tagged '{tag}'")
    return path


def _no_latest(save_dir: Path) -> str:
    """Why a run without `latest` has no checkpoint to read by default, and what to pass instead."""
    tags = sorted(path.name for path in save_dir.iterdir() if path.is_dir() and is_checkpoint(path))
    if not tags:
        return (
            f"{save_dir}: no '{LATEST}' file and no checkpoint: the run has not saved one yet (it saves every "
            "train.save_interval steps and at its end); train it that far, or pass a run that has"
        )
    return f"{save_dir}: no '{LATEST}' file; pass a tag, one of: {', '.join(tags)}"


def is_run(folder: Path) -> bool:
    """Whether `folder` is a training run's SAVE_DIR."""
    return (folder / CONFIG_FILE).exists() and (folder / LATEST).exists()


def committed(checkpoint: Path, latest: int) -> bool:
    """Whether a checkpoint is a finished save: any tag but a global_stepN is (averages, conversions and
    best ones are staged whole); a global_stepN is once it has a manifest, or (runs from before manifests)
    when its step is not past `latest`'s, which a save moves last."""
    match = STEP_TAG.fullmatch(checkpoint.name)
    return match is None or (checkpoint / MANIFEST).exists() or int(match[1]) <= latest


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
