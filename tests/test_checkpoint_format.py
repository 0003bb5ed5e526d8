"""A checkpoint of an older fathom reads as today's format, one of a newer fathom is refused in one line,
and what an older average recorded outside any manifest is still read (common/checkpoint_format.py); a
damaged manifest or `latest` is one line naming the file."""

import json
from pathlib import Path

import pytest
import torch

from fathom.common.checkpoint_format import (
    FORMAT,
    MANIFEST,
    MODEL_STATES,
    file_entry,
    load_file,
    read_manifest,
    schedule_step,
)
from fathom.common.errors import ConfigError
from fathom.common.run_layout import LATEST, latest_tag

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


SHAPE = {"stages": 1, "replicas": 1, "bounds": [0, 9]}
GOOD = {"format": FORMAT, "tag": "global_step10", "step": 10, "schedule_step": 10, "world_size": 1,
        "files": {MODEL_STATES: {"bytes": 1, "zip": True}}, "shape": SHAPE}  # fmt: skip


def without(key: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != key}


DAMAGED = {  # each was a traceback (JSONDecodeError, TypeError, KeyError, ...) or read as valid
    "truncated": ('{"format": 2, "tag": "glo', "not JSON"),
    "empty": ("", "not JSON"),
    "not UTF-8": (b'{"format": 2, "tag": "\xff"}', "not text (byte 0xff at 22 is not UTF-8)"),
    "a list": ([GOOD], "not a JSON object"),
    "format a string": ({**GOOD, "format": "2"}, "'format' is \"2\", not a format number"),
    "format null": ({**GOOD, "format": None}, "'format' is null, not a format number"),
    "format -1": ({**GOOD, "format": -1}, "'format' is -1, not a format number"),
    "format true": ({**GOOD, "format": True}, "'format' is true, not a format number"),
    "no files": (without("files"), "no 'files'"),
    "no shape": (without("shape"), "no 'shape'"),
    "a shape without replicas": ({**GOOD, "shape": {"stages": 1, "bounds": None}}, "'shape' is {"),
    "no schedule_step": (without("schedule_step"), "no 'schedule_step'"),
    "no step": (without("step"), "no 'step'"),
    "a first format without a step": ({"tag": "global_step10", "files": {}}, "no 'step'"),
    "bytes a string": (
        {**GOOD, "files": {MODEL_STATES: {"bytes": "21033", "zip": True}}},
        f'\'files\' has {MODEL_STATES}: {{"bytes": "21033"',
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", DAMAGED, ids=list(DAMAGED))
def test_a_damaged_manifest_is_one_line_naming_it(tmp_path, case):
    """The manifest's one reader checks every key's type: what the readers after it (resume, translation,
    averaging, and any file of the checkpoint loaded) take from it can be relied on."""
    content, problem = DAMAGED[case]
    checkpoint = checkpoint_with(tmp_path, None, {"global_steps": 10})
    raw = content if isinstance(content, (str, bytes)) else json.dumps(content)
    (checkpoint / MANIFEST).write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    for read in (read_manifest, schedule_step, lambda c: load_file(c / MODEL_STATES)):
        with pytest.raises(ConfigError) as err:
            read(checkpoint)
        message = str(err.value)
        assert message.startswith(f"{checkpoint / MANIFEST}: ") and problem in message, message
        assert "restore it" in message and "\n" not in message


def test_an_average_has_no_shape(tmp_path):
    checkpoint = checkpoint_with(tmp_path, {**GOOD, "shape": None, "world_size": None}, {"global_steps": 10})
    assert read_manifest(checkpoint)["shape"] is None


@pytest.mark.parametrize(
    "content, problem",
    [(b"\xffglobal_step2", "not text"), (b"", "empty"), (b"\n", "empty"), (b"../run/global_step2", "not a tag")],
    ids=["not UTF-8", "empty", "a newline", "a path"],
)
def test_a_damaged_latest_is_one_line_naming_it(tmp_path, content, problem):
    """`latest` not UTF-8 was a UnicodeDecodeError; empty (DeepSpeed's own write cut off), it passed the
    checks before --resume and failed inside DeepSpeed (check_ckpt_list)."""
    checkpoint_with(tmp_path, GOOD, {"global_steps": 10})
    (tmp_path / LATEST).write_bytes(content)
    with pytest.raises(ConfigError) as err:
        latest_tag(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / LATEST}: ") and problem in message, message
    assert "global_step10" in message and "\n" not in message  # the checkpoint to name instead
    (tmp_path / "global_step10" / MANIFEST).unlink()
    with pytest.raises(ConfigError, match="the run has no committed checkpoint: remove it, or write into it"):
        latest_tag(tmp_path)


def test_a_checkpoints_client_state_is_one_record_read_one_way():
    """The client state was a dict the loop wrote and three modules read, each with its own default for a key an
    older checkpoint lacks: ClientState is the record, written and read back whole, and `read` alone gives an
    older checkpoint's missing keys their meaning (no validation yet, no init_from offset, no recorded position,
    a best loss from before losses were per target token)."""
    from fathom.common.checkpoint_format import ClientState

    now = ClientState({"loss": 3.8, "bleu": 21.5}, schedule_offset=40, data_position={"micro_batches": 8})
    assert ClientState.read({"global_steps": 9, **now.to_dict()}) == now
    assert ClientState.read({"global_steps": 9}) == ClientState({}, 0, None, loss_per_token=False)
    assert ClientState.read({"best_valid_loss": 4.1}).best == {"loss": 4.1}
