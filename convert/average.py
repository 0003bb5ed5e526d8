"""Average the weights of several pipeline checkpoints of one run into a new checkpoint tag (what
fairseq's scripts/average_checkpoints.py does for its checkpoints).

    python scripts/average_checkpoints.py --checkpoint SAVE_DIR --last K [--out-tag TAG] [--force]
    python scripts/average_checkpoints.py --checkpoint SAVE_DIR --tags TAG TAG [TAG ...] [--out-tag TAG] [--force]

--last K takes the K newest committed global_stepN checkpoints by N (committed: the tag has
fathom_manifest.json, or, in a run from before manifests, its step is not past `latest`'s);
uncommitted leftovers of crashed saves and best_global_step* are never picked. --tags takes the
named tags (best and best_global_stepN too; global_stepN and best_global_stepN are one checkpoint,
saved after the same step, and naming both is refused). Each tensor of each layer file (layer_XX-model_states.pt)
becomes the arithmetic mean over the checkpoints, accumulated in float64 and stored in the tensor's
own dtype; tensors that are not floating point (none in fathom's layers) are taken from the newest.
Layer files are read one at a time, from each checkpoint in turn: memory holds one layer's running
sum (float64) and one layer file, never a whole model, let alone K of them.

The new tag SAVE_DIR/TAG (default avg_lastK for --last; for --tags avg_ and the tags' names without
`global_step`, oldest first: --tags global_step2000 global_step1800 writes avg_1800_2000) holds the
averaged layer files, fathom_average.json (what was averaged) and a manifest (common/checkpoint_format.py)
recording every file and the newest checkpoint's step and schedule step. From Python:
`average_checkpoints(run_dir, last=K)` or `average_checkpoints(run_dir, tags=[...])`. scripts/generate.py and
scripts/convert_to_fairseq.py read it like any other tag (--tag TAG). Its step is the NEWEST averaged
checkpoint's, so values computed from the step (BranchNorm's alpha_t) are the ones the newest of the
averaged weights were trained with; no step matches a mean of weights exactly, and the newest is where
the run ended up. It has no optimizer, scheduler or data-loader state (those stay in the source tags): it
is for translating and exporting, not for resuming, and `latest` and `best` are left where they are.

The tag is written to a hidden directory inside SAVE_DIR and renamed into place when complete; an
error leaves nothing behind. An existing TAG is refused unless --force, which replaces only an
earlier average; so are the names a run keeps for its checkpoints and records, written or not yet
(global_step*, best*, latest, metrics.jsonl, grad_norms.jsonl, translations, ...: RUN_RECORDS in
common/run_layout.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fathom.common.checkpoint_format import (
    file_damage,
    global_step,
    layer_file,
    layer_files,
    load_file,
    manifest_files,
    new_manifest,
    read_manifest,
    schedule_step,
    write_manifest,
)
from fathom.common.cli import command_parser
from fathom.common.errors import ConfigError, exit_on_config_error
from fathom.common.files import fsync_dir, save_file, staged
from fathom.common.run_layout import (
    AVERAGE_SUMMARY,
    CONFIG_FILE,
    average_tag,
    committed,
    committed_checkpoints,
    is_folder_name,
    latest_step,
    reserved_name,
    tag_step,
)
from fathom.model.model_config import ModelConfig
from fathom.model.trained import missing_layer_files, model_config, saved_layers

ONE_RUN = "average checkpoints of one run"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument("--checkpoint", required=True, help="train.save_dir of a run")
    parser.add_argument("--last", type=int, default=None, metavar="K", help="average the K newest checkpoints")
    parser.add_argument("--tags", nargs="+", default=None, metavar="TAG", help="average these checkpoint tags")
    parser.add_argument(
        "--out-tag",
        default=None,
        help="tag to write inside SAVE_DIR (default: avg_lastK for --last; for --tags avg_ and the tags' "
        "names without 'global_step', oldest first, e.g. avg_1800_2000)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output tag")
    return parser.parse_args(argv)


def last_checkpoints(save_dir: Path, k: int) -> list[Path]:
    """The k newest committed global_stepN checkpoints by N."""
    found = committed_checkpoints(save_dir)
    if len(found) < k:
        have = ", ".join(path.name for _, path in found) or "none"
        raise ConfigError(
            f"--last {k}: {save_dir} has {len(found)} committed checkpoints ({have}); "
            + (f"pass --last {len(found)} or fewer" if len(found) >= 2 else "train until it has saved at least 2")
        )
    return [path for _, path in found[-k:]]


def identity(checkpoint: Path) -> int | Path:
    """What tells checkpoints apart: a training checkpoint's step (global_stepN and best_global_stepN are
    saved after the same step, with the same weights; `best` links to one), another tag's folder."""
    real = checkpoint.resolve()
    step = tag_step(real.name)
    return real if step is None else step


def named_checkpoints(save_dir: Path, tags: list[str]) -> list[Path]:
    """The checkpoint directories the tags name, each once."""
    seen: dict[int | Path, str] = {}
    latest = latest_step(save_dir)
    for tag in tags:
        if not is_folder_name(tag):
            raise ConfigError(f"--tags: '{tag}' is not a tag; pass folder names inside {save_dir}, e.g. global_step2")
        path = save_dir / tag
        if not path.is_dir():
            newest = ", ".join(p.name for _, p in committed_checkpoints(save_dir)[-3:]) or "none"
            raise ConfigError(
                f"--tags: {save_dir} has no checkpoint tagged '{tag}'; pass tags it has (newest: {newest})"
            )
        if not committed(path, latest):
            raise ConfigError(f"--tags: {path} is a save that did not finish; pick committed checkpoints")
        if (same := identity(path)) in seen:
            raise ConfigError(
                f"--tags: '{seen[same]}' and '{tag}' are the same checkpoint"
                + (f" (both saved after step {same})" if isinstance(same, int) else "")
                + "; name each checkpoint once, at least 2 different ones"
            )
        seen[same] = tag
    if len(seen) < 2:
        raise ConfigError(f"--tags: averaging needs at least 2 checkpoints, got {len(seen)}; name 2 or more")
    return [save_dir / tag for tag in seen.values()]


def check_out_tag(save_dir: Path, tag: str, checkpoints: list[Path], force: bool) -> None:
    """Fails unless `tag` is a new (or, with force, an earlier averaged) tag that no reader takes for
    something else: a training checkpoint, `latest`, `best`."""
    if not is_folder_name(tag):
        raise ConfigError(f"--out-tag: '{tag}' is not a folder name; pass a folder name such as avg_last5")
    if reserved_name(tag):
        raise ConfigError(
            f"--out-tag: '{tag}' is a name the run keeps for its checkpoints, links or records; "
            "choose another, such as avg_last5"
        )
    out = save_dir / tag
    if any(out.resolve() == path.resolve() for path in checkpoints):
        raise ConfigError(f"--out-tag: '{tag}' is one of the averaged checkpoints; choose another name")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"--out-tag: {out} exists and is not a checkpoint folder; choose another name")
    if out.exists() and not (out / AVERAGE_SUMMARY).exists():
        raise ConfigError(f"--out-tag: {out} exists and was not written by this script; choose another name")
    if out.exists() and not force:
        raise ConfigError(f"--out-tag: {out} already exists; choose another --out-tag or pass --force to replace it")


def layer_names(cfg: ModelConfig) -> list[str]:
    """The layer files a checkpoint of this model has, in spec order."""
    return [layer_file(Path(), index).name for index, _ in saved_layers(cfg)]


def check_layer_files(cfg: ModelConfig, checkpoints: list[Path]) -> list[str]:
    """The layer files to average; fails unless every checkpoint has exactly those, at their saved sizes."""
    names = layer_names(cfg)
    for checkpoint in checkpoints:
        missing_layer_files(cfg, checkpoint)
        if extra := sorted({path.name for path in layer_files(checkpoint)} - set(names)):
            raise ConfigError(
                f"{checkpoint}: has {extra[0]}, which the model in {checkpoint.parent / CONFIG_FILE} has no layer "
                f"for; the checkpoint is from another model: {ONE_RUN}"
            )
        saved = (read_manifest(checkpoint) or {}).get("files", {})
        for name in names:
            if name in saved and (problem := file_damage(checkpoint / name, saved[name], read=False)):
                raise ConfigError(f"{problem.split(';')[0]}; restore the file, or average other checkpoints")
    return names


def describe(value: Any) -> str:
    return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}" if torch.is_tensor(value) else "no tensor"


def average_layer(paths: list[Path]) -> dict[str, Any]:
    """The mean of one layer file over checkpoints (the newest last), reading one file at a time;
    fails unless every file has the same tensor names, shapes and dtypes."""
    state = load_file(paths[0])
    kinds = {key: describe(value) for key, value in state.items()}
    sums = {key: value.double() for key, value in state.items() if torch.is_floating_point(value)}
    for path in paths[1:]:
        state = load_file(path)
        if odd := sorted(state.keys() ^ kinds.keys()):
            raise ConfigError(
                f"{path}: '{odd[0]}' is in {'this file' if odd[0] in state else paths[0]} only; the checkpoints "
                f"are from different models: {ONE_RUN}"
            )
        for key, value in state.items():
            if describe(value) != kinds[key]:
                raise ConfigError(
                    f"{path}: '{key}' is {describe(value)} but {kinds[key]} in {paths[0]}; the checkpoints are "
                    f"from different models: {ONE_RUN}"
                )
            if key in sums:
                sums[key] += value.double()
    # what is not floating point (no fathom layer has any) is the newest checkpoint's
    return {key: (sums[key] / len(paths)).to(value.dtype) if key in sums else value for key, value in state.items()}


def by_step(checkpoints: list[Path]) -> list[tuple[int, Path]]:
    """(step, checkpoint), oldest first."""
    return sorted((global_step(checkpoint), checkpoint) for checkpoint in checkpoints)


def average(
    save_dir: Path, checkpoints: list[tuple[int, Path]], names: list[str], out_tag: str, force: bool = False
) -> dict[str, Any]:
    """Writes the mean of the layer files `names` of `checkpoints` (by_step's) to SAVE_DIR/out_tag, at
    the newest checkpoint's step; returns the summary."""
    summary = {
        "averaged": [checkpoint.name for _, checkpoint in checkpoints],
        "steps": [step for step, _ in checkpoints],
        "global_steps": checkpoints[-1][0],
        "layer_files": len(names),
        "note": "weights: the mean of the averaged checkpoints'; global_steps: the newest one's",
    }
    with staged(save_dir / out_tag, force) as staging:
        for name in names:
            save_file(average_layer([checkpoint / name for _, checkpoint in checkpoints]), staging / name)
        (staging / AVERAGE_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        newest = checkpoints[-1][1]
        files = manifest_files(staging)
        write_manifest(staging, new_manifest(out_tag, summary["global_steps"], schedule_step(newest), files, None))
    fsync_dir(save_dir)
    return summary


class Averaged(NamedTuple):
    tag: str  # written inside the run directory
    summary: dict[str, Any]  # fathom_average.json


def average_checkpoints(
    run_dir: str | Path,
    last: int | None = None,
    tags: list[str] | None = None,
    out_tag: str | None = None,
    force: bool = False,
) -> Averaged:
    """Averages the run's `last` K newest committed checkpoints, or those `tags` name (exactly one of
    the two), into the tag `out_tag` (default as the command's; an earlier average of that name is
    replaced only with `force`). Checks everything first: fails in one ConfigError line, writing nothing."""
    if (last is None) == (tags is None):
        raise ConfigError("pass exactly one of --last K (the K newest checkpoints) and --tags TAG TAG ...")
    if last is not None and last < 2:
        raise ConfigError(f"--last {last}: averaging needs at least 2 checkpoints; pass --last 2 or more")
    save_dir = Path(run_dir)
    cfg = model_config(save_dir)
    chosen = named_checkpoints(save_dir, tags) if last is None else last_checkpoints(save_dir, last)
    checkpoints = by_step(chosen)
    if out_tag is None:
        out_tag = average_tag([path.name for _, path in checkpoints], last)
    check_out_tag(save_dir, out_tag, chosen, force)
    names = check_layer_files(cfg, chosen)
    return Averaged(out_tag, average(save_dir, checkpoints, names, out_tag, force))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_config_error():
        out_tag, summary = average_checkpoints(args.checkpoint, args.last, args.tags, args.out_tag, args.force)
    print(
        f"wrote {Path(args.checkpoint) / out_tag}: the mean of {', '.join(summary['averaged'])} "
        f"({summary['layer_files']} layer files) at step {summary['global_steps']}, the newest; "
        f"read it with --tag {out_tag}"
    )
