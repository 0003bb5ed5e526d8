"""Hostile checkpoints and data on --resume, export and generation: each is one line on stderr, exit
status 2, nothing in the run directory rewritten; no checkpoint file can run code when loaded."""

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fathom.common.checkpoint_format import (
    LOSS_PER_TOKEN,
    MANIFEST,
    MODEL_STATES,
    ClientState,
    deepspeed_state_types,
    file_damage,
    load_file,
    read_manifest,
)
from fathom.common.errors import ConfigError
from fathom.common.jsonl import read_jsonl
from fathom.common.run_layout import BEST, CONFIG_FILE, DEEPSPEED_CONFIG_FILE, LATEST, latest_tag, linked_best
from fathom.convert.average import main as average_main
from fathom.corpus.dataset import BinarizedCorpus, file_record
from fathom.pipeline.checkpoint import saving
from fathom.pipeline.checkpoint.run_directory import RunDirectory
from fathom.pipeline.config.deepspeed_values import OUR_SECTIONS
from fathom.pipeline.config.engine_defaults import engine_config
from fathom.pipeline.train import main
from fathom.pipeline.validation import Best, validate, validation_line
from fathom.translation.generate import main as generate_main
from fathom.translation.translate import main as translate_main
from tests.helpers import ROOT, assert_same_training, built_once, edit_prepared, launch, snapshot

DEFAULT = ROOT / "ds_configs" / "default.json"
SMALL = ["model.encoder_layers=2", "model.decoder_layers=2", "train.save_interval=1", "train.log_interval=1"]


def train_args(run: Path, data: Path, *overrides: str) -> list[str]:
    return ["--config", str(DEFAULT), "--override", *SMALL, f"data.path={data}", f"train.save_dir={run}",
            "train.max_steps=2", *overrides]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory, multi30k_slice) -> Path:
    """A 2-stage run of 2 steps on real pairs, checkpointed at both steps."""

    def train(folder: Path) -> None:
        assert launch(ROOT / "scripts" / "train.py", *train_args(folder / "run", multi30k_slice)).returncode == 0

    return built_once(tmp_path_factory, "checkpoint_safety_trained", train) / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy, symlinks=True)
    return copy


def resume_fails(capsys, monkeypatch, run: Path, data: Path, *overrides: str, world_size: int = 2) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    before = snapshot(run)
    with pytest.raises(SystemExit) as exc:
        main([*train_args(run, data, "train.max_steps=4", *overrides), "--resume"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fathom: error: "), err
    assert snapshot(run) == before, "a refused resume changed the run directory"
    return err


def latest_file(run: Path, pattern: str) -> Path:
    return sorted((run / latest_tag(run)).glob(pattern))[-1]


@pytest.mark.slow
def test_checkpoints_are_committed_whole(trained):
    assert latest_tag(trained) == "global_step2"
    for tag in ("global_step1", "global_step2"):
        manifest = read_manifest(trained / tag)
        assert manifest == json.loads((trained / tag / MANIFEST).read_text()), "written in today's format"
        assert manifest["world_size"] == 2 and manifest["step"] == int(tag[-1])
        on_disk = {p.name for p in (trained / tag).iterdir()} - {MANIFEST}
        assert set(manifest["files"]) == on_disk and any(n.startswith("zero_pp_rank") for n in on_disk)
        for name, entry in manifest["files"].items():
            assert entry["zip"] and file_damage(trained / tag / name, entry, read=True) is None


@pytest.mark.slow
def test_the_run_records_its_config_as_written_and_the_config_deepspeed_received(trained):
    """config.json holds the run's config as its file says it (a resume compares with it); deepspeed_config.json
    what deepspeed.initialize was given, fathom's engine defaults (pipeline/config/engine_defaults.py) filled
    in. The check once wrote pipeline.use_reentrant=false into config.json, as if the run had chosen it."""
    written = json.loads((trained / CONFIG_FILE).read_text())
    received = json.loads((trained / DEEPSPEED_CONFIG_FILE).read_text())
    assert "use_reentrant" not in written["pipeline"]
    deepspeeds_keys = {key: value for key, value in written.items() if key not in OUR_SECTIONS}
    assert received == engine_config(deepspeeds_keys) != deepspeeds_keys
    assert received["pipeline"]["use_reentrant"] is False and received["timers"]["throughput"]["enabled"] is False


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["model.embed_dim=32"], 2, "--resume: model.embed_dim is 64 in"),
        (["model.norm_scheme=pre_ln"], 2, "--resume: model.norm_scheme is branchnorm in"),
        # another order of the data: no first unread micro-batch to go on from (tests/test_data_position.py)
        (["data.max_tokens=300"], 2, "--resume: data.max_tokens is null in global_step2 but 300 here"),
        (
            ["train_micro_batch_size_per_gpu=4", "train_batch_size=16"],
            2,
            "--resume: train_micro_batch_size_per_gpu is 8 in global_step2 but 4 here",
        ),
        (["train.seed=7"], 2, "--resume: train.seed is 1 in global_step2 but 7 here"),
        (["pipeline.stages=5"], 5, "pipeline.stages: 5 stages for 4 Transformer layers; use at most 4 stages"),
        # the optimizer state is kept in the form its precision, ZeRO stage and optimizer gave it
        (
            ["bf16.enabled=true"],
            2,
            "--resume: global_step2 was trained in fp32 and this config trains in bf16; "
            "its optimizer state is kept in fp32's form: resume with bf16.enabled=false",
        ),
        (["zero_optimization.stage=0"], 2, "--resume: zero_optimization.stage is 1 in global_step2 but 0 here"),
        (["optimizer.params.torch_adam=false"], 2, "optimizer.params.torch_adam is true in global_step2 but false"),
        # a scheme's initialization acts only when a run starts: it was printed as a change and ignored (issue 50)
        (["model.branchnorm.init=fairseq"], 2, '--resume: model.branchnorm.init is "deepnorm" in'),
        (["model.deepnorm.init=torchscale"], 2, '--resume: model.deepnorm.init is "paper" in'),
    ],
)
def test_resume_refuses_another_model_or_layout(capsys, monkeypatch, run, multi30k_slice, overrides, world_size,
                                                message):  # fmt: skip
    assert message in resume_fails(capsys, monkeypatch, run, multi30k_slice, *overrides, world_size=world_size)


@pytest.mark.slow
def test_resume_refuses_a_truncated_or_missing_file(capsys, monkeypatch, run, multi30k_slice):
    layer = latest_file(run, "layer_*")
    with open(layer, "r+b") as f:
        f.truncate(layer.stat().st_size // 2)
    assert "bytes, but" in resume_fails(capsys, monkeypatch, run, multi30k_slice)
    assert "truncated" in resume_fails(capsys, monkeypatch, run, multi30k_slice)
    latest_file(run, "zero_pp_rank_*").unlink()
    layer.unlink()
    assert "missing; restore the file" in resume_fails(capsys, monkeypatch, run, multi30k_slice)


def edited_manifest(edit: Callable[[dict], Any]) -> Callable[[Path], None]:
    """Rewrites the manifest of the checkpoint `latest` names with edit(manifest)."""

    def damage(run: Path) -> None:
        path = run / latest_tag(run) / MANIFEST
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))

    return damage


def entry_bytes_as_text(manifest: dict) -> dict:
    name, entry = next(iter(manifest["files"].items()))
    return {**manifest, "files": {**manifest["files"], name: {**entry, "bytes": str(entry["bytes"])}}}


# What damages the metadata of the checkpoint `latest` names (global_step2), and what the line says of it;
# tests/test_checkpoint_format.py goes through every such case on the readers.
DAMAGED_METADATA = {
    "truncated manifest": (lambda run: (run / "global_step2" / MANIFEST).write_text('{"format": 2, "ta'), "not JSON"),
    "format a string": (edited_manifest(lambda m: {**m, "format": "2"}), "'format' is \"2\""),
    "no files": (edited_manifest(lambda m: {k: v for k, v in m.items() if k != "files"}), "no 'files'"),
    "a list": (edited_manifest(lambda m: [m]), "not a JSON object"),
    "bytes a string": (edited_manifest(entry_bytes_as_text), "'files' has "),
    "latest not UTF-8": (lambda run: (run / LATEST).write_bytes(b"global_step\xff2"), "not text"),
}


LATEST_FIX = "write the tag to go on from into it (the newest committed checkpoint: global_step2)"


def refused(capsys, main_function: Callable[[list[str]], None], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main_function(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("fathom: error: "), err
    return err


@pytest.mark.slow
def test_damaged_checkpoint_metadata_is_one_line_in_resume_translate_and_average(
    capsys, monkeypatch, run, multi30k_slice, tmp_path
):
    """Each was a traceback (JSONDecodeError, TypeError, KeyError, UnicodeDecodeError), in --resume,
    translate.py and average_checkpoints.py alike; `latest` naming an average failed in --resume with
    `'NoneType' object is not subscriptable`, and an empty `latest` passed the checks before launch and
    failed inside DeepSpeed (check_ckpt_list). Now one line names the damaged file and what to do."""
    source = tmp_path / "source.de"
    source.write_text("Ein Hund.\n")
    translate = ["--checkpoint", str(run), "--data", str(multi30k_slice), "--input", str(source)]
    average = ["--checkpoint", str(run), "--last", "2"]
    whole = {path: path.read_bytes() for path in (run / LATEST, run / "global_step2" / MANIFEST)}
    for case, (damage, problem) in DAMAGED_METADATA.items():
        damage(run)
        blamed = f"{run / LATEST}: " if "latest" in case else f"{run / 'global_step2' / MANIFEST}: "
        fix = LATEST_FIX if "latest" in case else "the manifest is damaged: restore it"
        for err in (
            resume_fails(capsys, monkeypatch, run, multi30k_slice),
            refused(capsys, translate_main, translate),
            refused(capsys, average_main, average),
        ):
            assert err.startswith(f"fathom: error: {blamed}") and problem in err and fix in err, f"{case}: {err}"
        for path, content in whole.items():
            path.write_bytes(content)
    average_main([*average, "--out-tag", "avg_last2"])
    (run / LATEST).write_text("avg_last2")
    assert (
        f"--resume: {run / 'avg_last2'} records no pipeline shape, as an average of checkpoints does: it holds "
        "weights only, no optimizer or data state to go on from; start a new run from its weights with "
        f"train.init_from={run}"
    ) in resume_fails(capsys, monkeypatch, run, multi30k_slice)
    # the commands themselves: train.py --resume through launch.py's checks, which an empty `latest` passed
    (run / LATEST).write_text("")
    resume = ["--num_gpus", "2", str(ROOT / "scripts" / "train.py"), *train_args(run, multi30k_slice), "--resume"]
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), *resume], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2 and result.stderr == f"fathom: error: {run / LATEST}: empty; {LATEST_FIX}\n", (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
    (run / LATEST).write_text("global_step2")
    DAMAGED_METADATA["truncated manifest"][0](run)
    for script, argv in (("translate.py", translate), ("average_checkpoints.py", average)):
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *argv], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert result.returncode == 2 and result.stdout == "", result.stderr
        assert result.stderr.startswith(f"fathom: error: {run / 'global_step2' / MANIFEST}: not JSON"), result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr


ONE_STAGE = ["pipeline.stages=1", "gradient_accumulation_steps=2"]  # the run's batches as 1 stage x 2 replicas


def other_pairs(data: Path, out: Path) -> Path:
    """`data` with its test split's pairs as training pairs: the same dictionaries, other training data."""
    shutil.copytree(data, out)
    meta = json.loads((out / "meta.json").read_text())
    for lang in ("de", "en"):
        for ext in ("bin", "idx.npy"):
            shutil.copyfile(out / f"test.{lang}.{ext}", out / f"train.{lang}.{ext}")
            meta["files"][f"train.{lang}.{ext}"] = file_record(out / f"train.{lang}.{ext}")
    meta["splits"]["train"]["pairs"] = meta["splits"]["test"]["pairs"]
    (out / "meta.json").write_text(json.dumps(meta))
    return out


@pytest.mark.slow
def test_resume_refuses_other_training_pairs_or_shards(capsys, monkeypatch, run, multi30k_slice, tmp_path):
    """The same dictionaries, so the run's model fits: only the data's checksums tell the pairs apart."""
    other = other_pairs(multi30k_slice, tmp_path / "other")
    err = resume_fails(capsys, monkeypatch, run, other)
    assert "--resume: data.path holds other training pairs than global_step2 was trained on" in err
    assert "or set train.on_data_change=next_epoch to start epoch 2 in the new order" in err
    shards = json.dumps([str(multi30k_slice), str(other)])
    assert "data.path holds other training pairs" in resume_fails(capsys, monkeypatch, run, shards)


@pytest.mark.slow
def test_a_resume_with_another_accumulation_and_shape_reads_on_from_the_next_unread_micro_batch(
    trained, multi30k_slice, tmp_path
):
    """Saved at step 2 after 4 micro-batches a step on 2 stages, resumed on 1 stage x 2 replicas reading 1 each a
    step: steps 3 and 4 read micro-batches 8-11, step 3's of the uninterrupted run. They read 4-7 before
    (the position was recomputed as step x accumulation x replicas): step 2's, trained on twice."""
    full, run = tmp_path / "full", tmp_path / "run"
    assert launch(ROOT / "scripts" / "train.py", *train_args(full, multi30k_slice, "train.max_steps=3")).returncode == 0
    shutil.copytree(trained, run, symlinks=True)
    resumed = ["pipeline.stages=1", "gradient_accumulation_steps=1", "train_batch_size=16", "train.max_steps=4"]
    result = launch(ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice, *resumed), "--resume")
    assert result.returncode == 0
    assert f"resumed from {run}/global_step2 at step 2; data from micro-batch 8 (epoch 1: 8 of" in result.stdout
    tokens = {r["step"]: r["tokens"] for r in read_jsonl(run / "metrics.jsonl") if "tokens" in r}
    step3 = next(r["tokens"] for r in read_jsonl(full / "metrics.jsonl") if r["step"] == 3)
    assert tokens[3] + tokens[4] == step3, (tokens, step3)


@pytest.mark.slow
def test_a_resume_on_another_shape_refuses_a_damaged_checkpoint(capsys, monkeypatch, run, multi30k_slice):
    optimizer = latest_file(run, "zero_pp_rank_*")
    with open(optimizer, "r+b") as f:
        f.truncate(optimizer.stat().st_size - 1)
    assert "bytes, but" in resume_fails(capsys, monkeypatch, run, multi30k_slice, *ONE_STAGE)


@pytest.mark.slow
def test_a_resume_on_another_shape_into_a_save_dir_in_use_is_one_line(capsys, monkeypatch, run, multi30k_slice):
    running = RunDirectory(run, rank=0)
    running.open()  # what a running job's rank 0 holds
    try:
        assert "is in use by a running job" in resume_fails(capsys, monkeypatch, run, multi30k_slice, *ONE_STAGE)
    finally:
        running.close()


@pytest.mark.slow
def test_a_checkpoint_without_a_recorded_shape_or_partitions_resumes_only_on_its_shape(
    capsys, monkeypatch, run, multi30k_slice
):
    checkpoint = run / latest_tag(run)
    manifest = read_manifest(checkpoint)
    # ZeRO 0 keeps each stage's optimizer state whole in its model-states file
    unsharded = {**manifest, "files": {n: e for n, e in manifest["files"].items() if "zero_pp_rank" not in n}}
    (checkpoint / MANIFEST).write_text(json.dumps(unsharded))
    err = resume_fails(capsys, monkeypatch, run, multi30k_slice, *ONE_STAGE)
    assert "without ZeRO (zero_optimization.stage 0), which DeepSpeed cannot reshape; resume with 2 stages" in err
    (checkpoint / MANIFEST).unlink()  # as before fathom committed checkpoints
    err = resume_fails(capsys, monkeypatch, run, multi30k_slice, *ONE_STAGE)
    assert "global_step2 was written as 2 stages x 1 replica before fathom reshaped checkpoints; resume as" in err


@pytest.mark.slow
def test_resume_refuses_a_latest_naming_nothing(capsys, monkeypatch, run, multi30k_slice):
    (run / LATEST).write_text("global_step99")
    assert "names 'global_step99', which does not exist" in resume_fails(capsys, monkeypatch, run, multi30k_slice)


@pytest.fixture
def other_dictionary(multi30k_slice, tmp_path) -> Path:
    """The same data with two dictionary entries swapped: same sizes, other token ids."""
    data = tmp_path / "data"
    shutil.copytree(multi30k_slice, data)
    for name in ("dict.de.txt", "dict.en.txt"):
        edit_prepared(data, name, lambda lines: [*lines[:10], lines[11], lines[10], *lines[12:]])
    return data


@pytest.mark.slow
def test_resume_and_generate_refuse_a_dictionary_the_run_was_not_trained_with(
    capsys, monkeypatch, run, other_dictionary
):
    err = resume_fails(capsys, monkeypatch, run, other_dictionary)
    assert "dict.de.txt is not the dictionary the run in" in err
    with pytest.raises(SystemExit):
        generate_main(["--checkpoint", str(run), "--data", str(other_dictionary), "--subset", "valid"])
    assert "dict.de.txt is not the dictionary" in capsys.readouterr().err


def test_data_binarized_with_another_dictionary_is_refused(multi30k_slice, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(multi30k_slice, data)
    edit_prepared(data, "dict.en.txt", lambda lines: lines[:16])
    with pytest.raises(ConfigError, match=r"train\.en\.bin: token id \d+, but dict\.en\.txt has 20 entries"):
        BinarizedCorpus(data, "train")


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/tmp/fathom-test-unpickled-code")


def test_checkpoint_files_cannot_run_code(tmp_path):
    MARKER.unlink(missing_ok=True)
    evil = tmp_path / "layer_01-model_states.pt"
    torch.save({"weight": torch.zeros(2), "payload": RunsCode()}, evil)
    with pytest.raises(ConfigError, match="posix.system, which fathom does not unpickle"):
        load_file(evil)
    assert not MARKER.exists()
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(ConfigError, match="legacy.pt: "):
        load_file(legacy)
    assert not MARKER.exists()
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="garbage.pt: unreadable"):
        load_file(tmp_path / "garbage.pt")


@pytest.mark.slow
def test_deepspeed_optimizer_state_loads_without_unpickling_code(trained):
    state = saving.CommittingCheckpointEngine(True).load(str(latest_file(trained, "zero_pp_rank_*")))
    assert state["optimizer_state_dict"]["zero_stage"] == 1


def test_fp16_optimizer_state_loads_without_unpickling_code(tmp_path):
    """fp16 runs (GPU only) pickle their dynamic loss scaler into the optimizer state, as ZeRO-1 and
    DeepSpeed's FP16 optimizer do; --resume must load it under weights_only."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(2.0**16, 1000, 1, 2, False, True, torch.float16)
    scaler.cur_scale, scaler.last_overflow_iter = 2.0**15, 7  # as after an overflow at step 7
    torch.save({"loss_scaler": scaler, "dynamic_loss_scale": True}, tmp_path / "optim_states.pt")
    loaded = load_file(tmp_path / "optim_states.pt", allowed=deepspeed_state_types())["loss_scaler"]
    assert vars(loaded) == vars(scaler)


@pytest.mark.slow
def test_a_damaged_file_ends_every_rank_with_one_line(run, multi30k_slice, capsys):
    """Same size, one byte flipped: only the checksums see it, after the process group is up."""
    layer = latest_file(run, "layer_*")
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(data)
    with zipfile.ZipFile(layer) as archive:
        assert archive.testzip() is not None
    config_before = (run / "config.json").read_bytes()
    result = launch(ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice, "train.max_steps=4"), "--resume")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "fathom: error:" in line]
    assert len(errors) == 1 and "fails its checksum; the file is damaged" in errors[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert (run / "config.json").read_bytes() == config_before
    assert latest_tag(run) == "global_step2"
    # torch.load reads flipped tensor bytes without complaint: generate.py translated with them, and
    # train.init_from trained from them, both silently
    with pytest.raises(SystemExit) as exc:
        generate_main(["--checkpoint", str(run), "--data", str(multi30k_slice), "--subset", "valid"])
    assert exc.value.code == 2
    fresh = run.parent / "fresh"
    result = launch(ROOT / "scripts" / "train.py", *train_args(fresh, multi30k_slice, f"train.init_from={run}"))
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "fathom: error:" in line]
    assert result.returncode == 2 and len(errors) == 1 and "fails its checksum" in errors[0], output[-3000:]
    assert "Traceback" not in output and not fresh.exists(), "a failed start left its save_dir behind"


@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_line_naming_the_checkpoint_to_resume(run, multi30k_slice):
    """torch's zip writer reports a full disk as `RuntimeError: unexpected pos`, a traceback on every
    rank; a file size limit makes the layer files of step 3 fail as a full disk would."""
    result = launch(
        ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice, "train.max_steps=3"), "--resume",
        file_size_limit=20_000,
    )  # fmt: skip
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "fathom: error:" in line]
    assert result.returncode == 1 and len(errors) == 1, output[-3000:]
    assert "File too large while saving global_step3" in errors[0], errors[0]
    assert "--resume continues from global_step2" in errors[0], errors[0]
    assert "Traceback" not in output, output[-3000:]
    assert latest_tag(run) == "global_step2"
    result = launch(ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice, "train.max_steps=3"), "--resume")
    assert result.returncode == 0 and latest_tag(run) == "global_step3"


@pytest.mark.slow
def test_resume_drops_a_metrics_line_torn_by_a_crash(run, multi30k_slice):
    """A crash while rank 0 appends to metrics.jsonl leaves its last line cut short: --resume goes on,
    dropping it with one warning, and the log ends whole."""
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 4.1, "grad_no')
    result = launch(ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice, "train.max_steps=3"), "--resume")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    warnings = [line for line in output.splitlines() if "fathom: warning:" in line]
    assert len(warnings) == 1 and "metrics.jsonl: line 3 is cut short" in warnings[0], output[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3]


@pytest.mark.slow
def test_init_from_goes_on_with_alpha_from_the_source_step(trained, multi30k_slice, tmp_path):
    """train.init_from used to start BranchNorm at t = 0 on trained weights: alpha_t = 0 cuts every
    branch. The schedules now go on from the source's step, or from train.init_step."""
    for init_step, t in ((None, 2), (0, 0)):  # the source applied 2 updates
        fresh = tmp_path / f"fresh{t}"
        extra = [f"train.init_from={trained}", "train.max_steps=1"]
        extra += [] if init_step is None else [f"train.init_step={init_step}"]
        result = launch(ROOT / "scripts" / "train.py", *train_args(fresh, multi30k_slice, *extra))
        assert result.returncode == 0 and f"schedules from step {t}" in result.stdout
        assert read_jsonl(fresh / "metrics.jsonl")[0]["alpha"] == pytest.approx(t / 100)  # default.json: T = 100
        assert read_manifest(fresh / "global_step1")["schedule_step"] == t + 1


@pytest.mark.slow
def test_resume_refuses_another_precision_through_the_launcher(multi30k_slice, tmp_path):
    """A bf16 run resumed in fp32 blamed the checkpoint: `zero_pp_rank_0_mp_rank_00_optim_states.pt:
    unreadable (No such file ...); the file is truncated or not a checkpoint`."""
    run = tmp_path / "run"
    trained = launch(ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice, "bf16.enabled=true",
                                                               "train.max_steps=1"))  # fmt: skip
    assert trained.returncode == 0
    before = snapshot(run)
    result = launch(ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice), "--resume")
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "fathom: error:" in line]
    assert result.returncode == 2 and errors == [
        "fathom: error: --resume: global_step1 was trained in bf16 and this config trains in fp32; its optimizer "
        f"state is kept in bf16's form: resume with bf16.enabled=true, or start a new run from its weights with "
        f"train.init_from={run}"
    ], result.stdout[-3000:] + result.stderr[-3000:]
    assert snapshot(run) == before


@pytest.mark.slow
def test_resume_refuses_a_changed_start_setting(capsys, monkeypatch, run, trained, multi30k_slice):
    """train.init_from acts when a run starts: on a resume it was ignored without a word."""
    err = resume_fails(capsys, monkeypatch, run, multi30k_slice, f"train.init_from={trained}")
    assert f'--resume: train.init_from is null in {run} but "{trained}" here; it acts only when a run starts' in err


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_keeps_the_better_best(multi30k_slice, tmp_path):
    """With `latest` moved back (by hand, or a crash that lost newer tags), --resume took the best value from
    the checkpoint it resumed, then replaced the better `best` on disk by the first validation that beat
    that older value. The best a run has is the best it has on disk."""
    run, cadence = tmp_path / "run", ["train.save_interval=6", "train.valid_interval=2"]
    first = launch(ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice, "train.max_steps=12", *cadence))
    assert first.returncode == 0
    valid = {r["step"]: r["valid_loss"] for r in read_jsonl(run / "metrics.jsonl") if "valid_loss" in r}
    assert linked_best(run) == "best_global_step12" and valid[12] < valid[10] < valid[8] < valid[6]
    (run / "latest").write_text("global_step6")
    shutil.rmtree(run / "global_step12")
    resumed = launch(ROOT / "scripts" / "train.py", *train_args(run, multi30k_slice, "train.max_steps=10", *cadence),
                     "--resume")  # fmt: skip
    assert resumed.returncode == 0
    best = f"{valid[12]:.4f} nats ({valid[12] / math.log(2):.4f} bits)"
    assert f"fathom: best valid loss so far {best} (best_global_step12)" in resumed.stdout
    assert "warning" not in resumed.stderr  # its best loss is per target token, as this run's
    assert linked_best(run) == "best_global_step12" and read_manifest(run / "best_global_step12")
    assert [r["best_valid_loss"] for r in read_jsonl(run / "metrics.jsonl") if r.get("step") in (8, 10)
            and "valid_loss" in r] == [valid[12]] * 2  # fmt: skip


def test_a_best_loss_from_before_per_token_validation_is_named_on_resume(tmp_path):
    """A `best` checkpoint of a fathom whose validation loss was the mean of the micro-batches' means (a
    short micro-batch weighed as much as a full one) holds a value a resumed run's per-token losses
    cannot be compared with: the run says so; a best loss saved per target token is compared silently."""
    for per_token in (False, True):
        run = tmp_path / f"per_token_{per_token}"
        (run / "best_global_step4").mkdir(parents=True)
        state = {"best_valid_loss": 4.1096, **({LOSS_PER_TOKEN: True} if per_token else {})}
        torch.save(state, run / "best_global_step4" / MODEL_STATES)
        (run / BEST).symlink_to("best_global_step4")
        best = Best("loss", run)
        assert best.value == 4.1096
        if per_token:
            assert best.warning() is None
        else:
            assert best.warning() == (
                "best_global_step4's validation loss 4.1096 is a mean of micro-batch means (fathom before "
                "validation losses were per target token), not comparable with this run's; the first "
                "validation below it replaces best_global_step4"
            )
    assert ClientState({"loss": 3.8366}, 0, {}).to_dict()[LOSS_PER_TOKEN] is True  # what checkpoints now hold


def test_the_validation_line_gives_each_loss_in_nats_and_fairseqs_bits(tmp_path):
    """fairseq prints bits, fathom's losses are nats: the line names the unit of every loss, the best one's too."""
    record = {"step": 20, "valid_loss": 3.8366, "valid_nll_loss": 3.0, "valid_loss_bits": 3.8366 / math.log(2),
              "valid_nll_loss_bits": 3.0 / math.log(2)}  # fmt: skip
    best = Best("loss", tmp_path)
    best.update(3.8366)
    assert validation_line(record, best) == (
        "step 20 | valid loss 3.8366 nats (5.5350 bits) | valid nll_loss 3.0000 nats (4.3281 bits) "
        "| best loss 3.8366 nats (5.5350 bits)"
    )
    bleu = Best("bleu", tmp_path)
    bleu.update(31.2)
    assert validation_line({**record, "valid_bleu": 31.2, "valid_bleu_seconds": 2.5}, bleu).endswith(
        "| valid bleu 31.20 (2.5 s) | best bleu 31.2000"
    )


@pytest.mark.slow
def test_a_changed_learning_rate_applies_from_the_first_resumed_step(multi30k_slice, tmp_path):
    """A learning-rate change on --resume took effect one step late (the optimizer's saved rate ran the first
    step), a weight-decay change never (the saved param groups kept theirs), and config.json was overwritten,
    misstating the steps before. Steps 1-2 train at rate 0 (the warmup starts there), so a run whose settings
    change at step 2 must end with exactly the weights of one trained with the new settings throughout."""
    one_stage = ["pipeline.stages=1", "train.save_interval=2"]
    new = ["scheduler.params.warmup_max_lr=0.01", "optimizer.params.lr=0.01", "optimizer.params.weight_decay=0.5"]
    throughout, changed = tmp_path / "throughout", tmp_path / "changed"

    def train(save_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
        result = launch(ROOT / "scripts" / "train.py", *train_args(save_dir, multi30k_slice, *one_stage, *overrides),
                        processes=1)  # fmt: skip
        assert result.returncode == 0
        return result

    train(throughout, "train.max_steps=4", *new)
    train(changed, "train.max_steps=2")
    result = train(changed, "train.max_steps=4", *new, "--resume")
    assert (
        "fathom: from step 3 on: optimizer.params.lr 0.001 -> 0.01, optimizer.params.weight_decay 0.0001 -> 0.5, "
        "scheduler.params.warmup_max_lr 0.001 -> 0.01, train.max_steps 2 -> 4" in result.stdout
    ), result.stdout[-3000:]
    assert [r["lr"] for r in read_jsonl(changed / "metrics.jsonl")] == [0, 0.0, 0.0002, 0.0004]
    assert_same_training(throughout, changed)
    history = read_jsonl(changed / "config_history.jsonl")
    assert [(r["from_step"], r["config"]["optimizer"]["params"]["lr"]) for r in history] == [(0, 0.001), (2, 0.01)]
    assert json.loads((changed / "config.json").read_text()) == history[-1]["config"]


def test_a_replica_without_a_share_of_the_validation_set_still_joins_it(monkeypatch):
    """With fewer validation micro-batches than data-parallel replicas, a replica left without a share
    skipped eval_batch, which all-reduces its loss over the replicas: the others waited for it until the
    hang watchdog fired. It runs a stand-in micro-batch and adds nothing to the sums."""
    target = torch.tensor([[4, 5, 2]])

    class Engine:
        device = torch.device("cpu")
        grid = SimpleNamespace(get_data_parallel_rank=lambda: 1, get_data_parallel_world_size=lambda: 2)
        module = SimpleNamespace(loss_fn=None)
        scored: list[Any] = []

        def eval_batch(self, batches, num_micro_batches, bcast_loss):
            for _ in range(num_micro_batches):
                self.scored.append(next(batches))
                self.module.loss_fn(torch.zeros(1, 3, 8), target)

    reduced = []

    def all_reduce(sums: torch.Tensor) -> None:  # replica 0 scored that micro-batch's 3 tokens
        reduced.append(sums.clone())
        sums += torch.tensor([6.0, 3.0, 3.0], dtype=torch.float64)

    monkeypatch.setattr("fathom.pipeline.validation.dist.all_reduce", all_reduce)
    engine = Engine()
    assert validate(engine, ["the only micro-batch"], smoothing=0.1)["valid_loss"] == 2.0
    assert engine.scored == ["the only micro-batch"]  # joined the replicas' all-reduce
    assert reduced[0].tolist() == [0.0, 0.0, 0.0]  # and counted nothing: replica 0 counts that micro-batch
