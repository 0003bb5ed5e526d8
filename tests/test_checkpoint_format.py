"""A checkpoint of an older fathom reads as today's format, one of a newer fathom is refused in one line,
and what an older average recorded outside any manifest is still read (common/checkpoint_format.py)."""

import json
from pathlib import Path

import pytest
import torch

from common.checkpoint_format import FORMAT, MANIFEST, MODEL_STATES, file_entry, read_manifest, schedule_step
from common.errors import ConfigError

STAGE_FILES = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
OPTIMIZER_FILES = [f"zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt" for r in range(2) for s in range(2)]


def checkpoint_with(tmp_path: Path, manifest: dict | None, states: dict) -> Path:
    checkpoint = tmp_path / "global_step10"
    checkpoint.mkdir()
    torch.save(states, checkpoint / MODEL_STATES)
    if manifest is not None:
        if MODEL_STATES in manifest["files"]:  # read when upgrading: it must be the file the manifest lists
            manifest["files"][MODEL_STATES] = file_entry(checkpoint / MODEL_STATES)
        (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return checkpoint


def test_a_first_format_manifest_gains_its_schedule_step_and_shape(tmp_path):
    """fathom's first manifests had neither: the schedule step is then the updates applied (DeepSpeed
    counts skipped steps in global_steps), the shape one stage file per stage and one optimizer file per
    stage and replica."""
    files = {name: {"bytes": 1, "zip": True} for name in STAGE_FILES + OPTIMIZER_FILES}
    old = {"tag": "global_step10", "step": 10, "world_size": 4, "files": files}
    checkpoint = checkpoint_with(tmp_path, old, {"global_steps": 10, "skipped_steps": 2})
    manifest = read_manifest(checkpoint)
    assert manifest["format"] == FORMAT and manifest["schedule_step"] == 8 == schedule_step(checkpoint)
    assert manifest["shape"] == {"stages": 2, "replicas": 2, "bounds": None}
    assert {k: manifest[k] for k in old} == old


def test_a_recorded_schedule_step_and_shape_are_kept(tmp_path):
    shape = {"stages": 1, "replicas": 1, "bounds": [0, 9]}
    old = {"tag": "global_step10", "step": 10, "schedule_step": 14, "shape": shape, "files": {}}
    checkpoint = checkpoint_with(tmp_path, old, {"global_steps": 10, "skipped_steps": 2})
    assert read_manifest(checkpoint) == {**old, "format": FORMAT}


def test_a_checkpoint_of_a_newer_fathom_is_refused_in_one_line(tmp_path):
    newer = {"format": FORMAT + 1, "tag": "global_step10", "step": 10, "files": {}}
    checkpoint = checkpoint_with(tmp_path, newer, {"global_steps": 10})
    with pytest.raises(ConfigError, match=f"checkpoint format {FORMAT + 1}, written by a newer fathom") as err:
        schedule_step(checkpoint)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "states, step",
    [
        ({"global_steps": 10, "schedule_step": 7}, 7),  # an average of an older fathom
        ({"global_steps": 10, "skipped_steps": 3}, 7),  # a run from before manifests
    ],
)
def test_a_checkpoint_without_a_manifest_reads_its_counters(tmp_path, states, step):
    assert schedule_step(checkpoint_with(tmp_path, None, states)) == step
