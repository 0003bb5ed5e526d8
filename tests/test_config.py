"""Every bad-config case stops before training with one line naming the key and the fix."""

import dataclasses
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import typing

import pytest

from fathom.common import machine
from fathom.common.checkpoint_format import MANIFEST
from fathom.common.errors import ConfigError
from fathom.common.files import try_lock
from fathom.common.heap import CPU_HEAPS
from fathom.common.jsonl import read_jsonl
from fathom.common.run_layout import CONFIG_FILE, CONFIG_HISTORY, LATEST, LOCK_FILE, META_FILE, METRICS_FILE
from fathom.common.sections import OnResume, parse_section, resume_rule
from fathom.corpus.batches import SyntheticConfig
from fathom.model.model_config import ModelConfig
from fathom.model.norms import DEEPNORM_INITS, GROWTH, SCHEMES, BranchNorm, DeepNorm
from fathom.model.search import SearchConfig
from fathom.pipeline.checkpoint.run_directory import RunDirectory, check_not_in_use
from fathom.pipeline.config import deepspeed_values, resume_rules
from fathom.pipeline.config.deepspeed_keys import READ_BY_INITIALIZE, Recording, pipeline_defaults
from fathom.pipeline.config.deepspeed_sections import APPLIED, REFUSED
from fathom.pipeline.config.history import record_config
from fathom.pipeline.config.run_config import DataConfig, TrainConfig, ValidBleu, load_config
from fathom.pipeline.train import main
from fathom.study.grid import Grid, StudySpec
from tests.helpers import ROOT, deepspeed_launch, launch, snapshot

DEFAULT = ROOT / "ds_configs" / "default.json"


def write_config(tmp_path, mutate=None, text=None):
    path = tmp_path / "exp.json"
    if text is None:
        raw = json.loads(DEFAULT.read_text())
        raw["train"]["save_dir"] = str(tmp_path / "ckpt")
        if mutate:
            mutate(raw)
        text = json.dumps(raw)
    path.write_text(text)
    return path


def fail(capsys, args, world_size=2, monkeypatch=None):
    if monkeypatch:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def set_key(path, value):
    def mutate(raw):
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value

    return mutate


CASES = [
    (set_key(["model", "encoder_layer"], 6), "model.encoder_layer: unknown key; did you mean 'encoder_layers'?"),
    (set_key(["model", "embed_dim"], "64"), "model.embed_dim: expected an integer, got '64'"),
    (set_key(["train", "max_step"], 5), "train.max_step: unknown key; did you mean 'max_steps'?"),
    (set_key(["train", "valid_bleu"], {"beam": 4}), "train.valid_bleu: BLEU is computed at validations; set train"),
    (set_key(["train", "valid_bleu", "beem"], 4), "train.valid_bleu.beem: unknown key; did you mean 'beam'?"),
    (set_key(["train", "valid_bleu", "beam"], 0), "train.valid_bleu.beam: must be at least 1, got 0"),
    (set_key(["train", "best_metric"], "bleu"), "train.best_metric: bleu needs train.valid_bleu"),
    (set_key(["train", "best_metric"], "chrf"), "train.best_metric: 'chrf'; choose one of loss, bleu"),
    (set_key(["model", "norm_scheme"], "deep_norm"), "model.norm_scheme: unknown scheme 'deep_norm'"),
    (set_key(["model", "branchnorm", "growth"], "cubic"), "model.branchnorm.growth: 'cubic'"),
    (set_key(["model", "branchnorm", "TT"], 5), "model.branchnorm.TT: unknown key; did you mean 'T'?"),
    (set_key(["data", "synthetic", "word"], 5), "data.synthetic.word: unknown key; did you mean 'words'?"),
    (set_key(["pipeline", "stages"], 30), "pipeline.stages: 30 stages for 24 Transformer layers; use at most 24"),
    (set_key(["zero_optimization", "stage"], 2), "zero_optimization.stage: 2 is not supported"),
    (
        lambda raw: raw.update(bf16={"enabled": True}, zero_optimization={"stage": 0}),
        "bf16.enabled: DeepSpeed cannot resume bf16 checkpoints without ZeRO; set zero_optimization.stage to 1",
    ),
    (
        lambda raw: raw.update(fp16={"enabled": True}, zero_optimization={"stage": 0}),
        "fp16.enabled: DeepSpeed never scales the loss for fp16 without ZeRO; set zero_optimization.stage to 1",
    ),
    (
        set_key(["gradient_clip"], 1.0),
        "gradient_clip: neither a section of fathom's (model, data, train) nor a key DeepSpeed reads; did you mean "
        "'gradient_clipping'?",
    ),
    (
        set_key(["pipeline", "activation_checkpointing_interval"], 1),
        "pipeline.activation_checkpointing_interval: unknown key; did you mean 'activation_checkpoint_interval'?",
    ),
    (set_key(["train_batch_size"], 30), "train_batch_size: 30 != train_micro_batch_size_per_gpu 8 x"),
    # a resume on twice the replicas: the accumulation that keeps the run's batch is offered first
    (
        set_key(["gradient_accumulation_steps"], 8),
        "x gradient_accumulation_steps 8 x 1 data-parallel ranks; set gradient_accumulation_steps to 4 to keep 32 "
        "a step, or train_batch_size to 64",
    ),
    (set_key(["model", "embed_dim"], 66), "model.embed_dim: 66 is not divisible by model.attention_heads 4"),
    (lambda raw: raw.pop("train"), "train: missing section"),
    (
        lambda raw: raw["pipeline"].update(use_reentrant=True, activation_checkpoint_interval=1),
        "pipeline.use_reentrant: reentrant activation checkpointing fails",
    ),
]


# Typos at every level, as --override gives them (a study's grid is overrides): each would otherwise train
# another model than the one asked for, or the default setting, silently (issue 16).
TYPOS = {
    "modle.encoder_layers=2": "modle: neither a section of fathom's (model, data, train) nor a key DeepSpeed reads; "
    "did you mean 'model'?",
    "trian.max_steps=5": "trian: neither a section of fathom's",
    "Model.encoder_layers=24": "did you mean 'model'?",
    "optimizer.param.lr=0.1": "optimizer.param: not a key DeepSpeed reads (it would ignore it); did you mean 'params'?",
    "optimizer.params.lrr=0.1": "optimizer.params.lrr: not an argument of Adam; did you mean 'lr'?",
    "optimizer.type=Adamm": "optimizer.type: 'Adamm' is neither DeepSpeed's nor torch's; did you mean 'Adam'?",
    "scheduler.params.warmup_num_step=10": "scheduler.params.warmup_num_step: not an argument of WarmupLR; "
    "did you mean 'warmup_num_steps'?",
    "scheduler.type=WarmupDecay": "scheduler.type: 'WarmupDecay' is neither DeepSpeed's scheduler nor fathom's; "
    "use one of",
    "zero_optimization.stagee=1": "zero_optimization.stagee: not a key DeepSpeed knows; did you mean 'stage'?",
    "zero_optimization=1": "zero_optimization: DeepSpeed reads it as an object ({...}), got 1",
    "zero_optimization.offload_optimizer.pin_memroy=true": "zero_optimization.offload_optimizer.pin_memroy: not a "
    "key DeepSpeed knows; did you mean 'pin_memory'?",
    "zero_optimization.stage=x": "zero_optimization.stage: Input should be 0, 1, 2, 3",
    "bf16.enable=true": "bf16.enable: not a key DeepSpeed knows; did you mean 'enabled'?",
    "activation_checkpointing.partition_activation=true": "activation_checkpointing.partition_activation: not a key "
    "DeepSpeed reads (it would ignore it); did you mean 'partition_activations'?",
    "flops_profiler.enable=true": "flops_profiler.enable: not a key DeepSpeed reads",
    "model.branchnorm.TT=5": "model.branchnorm.TT: unknown key; did you mean 'T'?",
    "train.valid_bleu.beem=4": "train.valid_bleu.beem: unknown key",
    "data.synthetic.word=5": "data.synthetic.word: unknown key; did you mean 'words'?",
    "tensorboard.enabld=true": "tensorboard.enabld: not a key DeepSpeed knows; did you mean 'enabled'?",
}


def test_deepspeed_sections_it_validates_whole_pass(tmp_path, monkeypatch):
    """Sections DeepSpeed hands whole to a pydantic model (its monitors) are that model's to check."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    csv = '{"enabled": true, "output_path": "/tmp/csv", "job_name": "run"}'
    cfg = load_config(write_config(tmp_path), [f"csv_monitor={csv}", "tensorboard.enabled=false"], world_size=2)
    assert cfg.deepspeed["csv_monitor"] == json.loads(csv)  # handed to DeepSpeed as given
    assert cfg.deepspeed["tensorboard"]["enabled"] is False


def test_every_setting_declares_what_a_resume_does_with_a_change():
    """Each field of every section (the model's, each scheme's options, data, train) and each key of the
    pipeline section declares what --resume does with a change to it (common.sections.OnResume), the one
    place it is decided: a new setting without a declaration fails here instead of passing a resume
    unnoticed (model.deepnorm.init was printed as a change and ignored, issue 50)."""
    sections = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
    sections |= {f"model.{name}": scheme.Options for name, scheme in SCHEMES.items()}
    undeclared = [
        f"{where}.{field.name}"
        for where, cls in sections.items()
        for field in dataclasses.fields(cls)
        if resume_rule(field) is None and f"{where}.{field.name}" != "model.schemes"  # each scheme's, above
    ]
    undeclared += [f"pipeline.{key}" for key in pipeline_defaults() if f"pipeline.{key}" not in resume_rules.DEEPSPEED]
    assert undeclared == []
    # what the resume checks read: the weights' shapes, the start-only settings of every section and scheme
    assert "norm_scheme" in [f.name for f in dataclasses.fields(ModelConfig) if resume_rule(f) is OnResume.WEIGHTS]
    start_only = resume_rules.settings_with(OnResume.START_ONLY)
    assert {"train.init_from", "model.admin.profile", "model.deepnorm.init", "model.branchnorm.init"} <= set(start_only)


def number_type(hint: typing.Any) -> bool:
    """Whether a field of this type holds numbers (an int, a float, a list of them, optionally None)."""
    options = [hint, *typing.get_args(hint)]
    return any(o in (int, float) or typing.get_args(o) in ((int,), (float,)) for o in options if o is not bool)


def test_every_number_of_every_section_declares_its_bounds_and_its_error_names_the_key():
    """A number's range is declared once, in its field's metadata (common.sections.bounds), and parse_section
    enforces it with the key as the section was read; about twelve ranges were written by hand, each
    spelling its dotted key, and the search's needed a callback to spell it (issue 53)."""
    sections = {"model": ModelConfig, "data": DataConfig, "data.synthetic": SyntheticConfig, "train": TrainConfig}
    sections |= {f"model.{name}": scheme.Options for name, scheme in SCHEMES.items()}
    sections |= {"train.valid_bleu": ValidBleu, "study": StudySpec, "study.grids[0]": Grid}
    unbounded = []
    for where, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not number_type(hints[field.name]):
                continue
            if (declared := field.metadata.get("bounds")) is None:
                unbounded.append(f"{where}.{field.name}")
                continue
            wrong = float("nan") if declared.least == -math.inf else declared.least - 1
            value = (
                [wrong]
                if typing.get_origin(hints[field.name]) is list
                or list in map(typing.get_origin, typing.get_args(hints[field.name]))
                else wrong
            )
            with pytest.raises(ConfigError, match="^" + re.escape(f"{where}.{field.name}")):
                parse_section(cls, {field.name: value}, where)
    assert unbounded == []


def test_every_key_deepspeed_reads_is_applied_or_refused():
    """Each top-level key DeepSpeed 0.19.8 reads (and each of `checkpoint` fathom refuses) has its entry in
    pipeline/config/deepspeed_sections.py, or DeepSpeed refuses it itself (a feature it removed); a new
    DeepSpeed's new section fails here until someone decides what fathom's engine does with it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    recording = Recording({"train_micro_batch_size_per_gpu": 1})
    DeepSpeedConfig(recording)
    read = recording.seen[""] | READ_BY_INITIALIZE
    undecided = []
    for key in sorted(read - APPLIED.keys() - REFUSED.keys()):
        try:
            DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, key: {}})
        except Exception:  # noqa: BLE001 (DeepSpeed's own refusal, one line before launch)
            continue
        undecided.append(key)
    assert undecided == []
    assert APPLIED.keys().isdisjoint(REFUSED)
    tops = {key.split(".")[0] for key in [*APPLIED, *REFUSED]}
    assert tops <= read, f"entries for keys DeepSpeed does not read: {tops - read}"
    checkpoint = Recording({"train_micro_batch_size_per_gpu": 1, "checkpoint": {}})
    DeepSpeedConfig(checkpoint)
    refused = {key.split(".", 1)[1] for key in REFUSED if key.startswith("checkpoint.")}
    assert refused <= checkpoint.seen["checkpoint"]


@pytest.mark.parametrize(
    "overrides",
    [
        "flops_profiler.enabled=false",
        "wall_clock_breakdown=false",
        "activation_checkpointing.partition_activations=false activation_checkpointing.cpu_checkpointing=false",
        "managed_gradient_accumulation=true",
        "checkpoint.tag_validation=Fail checkpoint.load_universal=false",
        "bfloat16.enabled=false",
        "timers.throughput.enabled=false",  # fathom's own default for the engine
    ],
)
def test_a_refused_deepspeed_section_that_asks_for_nothing_passes(tmp_path, overrides):
    """A config copied from DeepSpeed's examples may switch a feature off explicitly: that is no setting
    that fails to act, and DeepSpeed reads it as if it were left out."""
    load_config(write_config(tmp_path), overrides.split(), world_size=2)


# Values that passed the start-up checks and then crashed every rank with a traceback, or trained silently
# with something else (issue 16).
VALUES = {
    "optimizer.params.lr=NaN": "optimizer.params.lr: nan is not a finite number",
    "train.hang_timeout=Infinity": "train.hang_timeout: inf is not a finite number",
    "optimizer.params.lr=-1": "optimizer.params: Invalid learning rate: -1",
    "optimizer.params.eps=-1": "optimizer.params: Invalid epsilon value: -1",
    "scheduler.params.warmup_num_steps=-1": "scheduler.params: warmup_num_steps must be a positive integer, got -1",
    "gradient_clipping=-1": "gradient_clipping: expected a number >= 0 (0: no clipping), got -1",
    "steps_per_print=0": "steps_per_print: expected an integer >= 1, got 0",
    "wall_clock_breakdown=true": "wall_clock_breakdown: DeepSpeed's pipeline engine fails with it (a timer started "
    "twice); train.time_breakdown=true times each pipeline instruction per step; remove it",
    # DeepSpeed sections that were accepted and did nothing in fathom's engine (issue 50)
    "flops_profiler.enabled=true flops_profiler.profile_step=1": "flops_profiler: DeepSpeed's pipeline engine never "
    "prints its profile",
    "activation_checkpointing.cpu_checkpointing=true": "activation_checkpointing: fathom checkpoints every "
    "pipeline.activation_checkpoint_interval layers with its own function",
    "data_efficiency.enabled=true": "data_efficiency: DeepSpeed's data sampling and routing act through its own data "
    "loader, which fathom does not use",
    # refused only once the engine was built, after the data was read and the process group made
    "checkpoint.writer.type=fast": "checkpoint.writer: it replaces the checkpoint engine, and fathom's crash-safe "
    "commit (fsync and a manifest of every file) needs DeepSpeed's torch checkpoint engine; remove it",
    # DeepSpeed trained in bf16 while fathom's precision() read fp32
    "bfloat16.enabled=true": "bfloat16: it is DeepSpeed's old name for bf16",
    "managed_gradient_accumulation=false": "managed_gradient_accumulation: DeepSpeed's pipeline engine accumulates "
    "the micro-batches of a step itself",
    "timers.throughput.enabled=true": "timers: DeepSpeed's pipeline engine starts its throughput timer and never "
    "reports it",
    "pipeline.partition=type:[": "pipeline.partition: 'type:[' is not a regular expression",
    "pipeline.partition=type:Nothing": "pipeline.partition: 'type:Nothing' matches no layer; the layers are",
    "pipeline.activation_checkpoint_interval=-1": "pipeline.activation_checkpoint_interval: expected an integer >= 0",
    "data.synthetic.words=0": "data.synthetic.words: must be at least 1, got 0",
    "data.synthetic.sentences=0": "data.synthetic.sentences: must be at least 1, got 0",
    "data.synthetic.max_len=1": "data.synthetic.max_len: 1 is below data.synthetic.min_len 3",
    "train.valid_interval=5 data.synthetic.valid_sentences=0": "train.valid_interval: the validation set is empty",
    "model.max_positions=4": "model.max_positions: 4 is below the longest training pair (7 tokens)",
    "train.seed=-1": "train.seed: must be in [0, 2147483648), got -1",
    "train.save_dir=": "train.save_dir: empty; name the directory for checkpoints",
    # a directory named ~ where the job ran
    "train.save_dir=~/runs/a": "train.save_dir: '~/runs/a' starts with ~, which a config does not expand",
    "train.save_dir=/proc/fathom-run": "train.save_dir: cannot write in /proc",
    "train.max_steps=0": "train.max_steps: must be at least 1, got 0",  # trained nothing, exit 0
    "train.cpu_heap=fast": "train.cpu_heap: 'fast'; choose one of keep, return",
    "train.init_step=5": "train.init_step: 5; it is the step train.init_from's weights start at",
    # DeepSpeed warned (silenced) and warmed up by log instead
    "scheduler.params.warmup_type=lienar": "scheduler.params.warmup_type: 'lienar'; choose one of linear, log",
    # a string from --override failed inside the scheduler's arithmetic
    "scheduler.params.warmup_max_lr=nan": "scheduler.params.warmup_max_lr: expected a number, got 'nan'",
    "optimizer.params.betas=[0.9]": "optimizer.params.betas: expected 2 numbers, e.g. [0.9, 0.999], got [0.9]",
    "optimizer.params.weight_decay=true": "optimizer.params.weight_decay: expected a number, got True",
    # DeepSpeed's refusal named only "Train batch size: 0"
    "train_micro_batch_size_per_gpu=0": "train_micro_batch_size_per_gpu: expected an integer >= 1, got 0",
    "gradient_accumulation_steps=0": "gradient_accumulation_steps: expected an integer >= 1, got 0",
    # a decay that ends before the run trained the last steps at rate 0; one inside its warmup only warned
    "scheduler.type=WarmupDecayLR scheduler.params.warmup_num_steps=2 scheduler.params.total_num_steps=3 "
    "train.max_steps=5": "scheduler.params.total_num_steps: 3 ends before train.max_steps 5",
    "scheduler.type=WarmupDecayLR scheduler.params.warmup_num_steps=4 scheduler.params.total_num_steps=3 "
    "train.max_steps=3": "scheduler.params.total_num_steps: 3 ends inside the warmup of 4 steps; set it to 4 or more",
    # DeepSpeed's values of another JSON type, which its pydantic sections convert and its other readers use as
    # they come: a string stage was refused for a false reason ("1 is not supported ... use 0 or 1"); true and
    # 1.0 trained at stage 1; "false" enabled fathom's bf16 checks while DeepSpeed trained in fp32 (issue 50)
    'zero_optimization.stage="1"': "zero_optimization.stage: expected an integer, got '1'",
    "zero_optimization.stage=true": "zero_optimization.stage: expected an integer, got True",
    "zero_optimization.stage=1.0": "zero_optimization.stage: expected an integer, got 1.0 (write 1)",
    # DeepSpeed's examples write sizes as 5e8, which JSON reads as a float
    "zero_optimization.reduce_bucket_size=5e8": "zero_optimization.reduce_bucket_size: expected an integer, got "
    "500000000.0 (write 500000000)",
    "zero_optimization.reduce_bucket_size=true": "zero_optimization.reduce_bucket_size: expected an integer, got True",
    "zero_optimization.offload_optimizer.pin_memory=1": "zero_optimization.offload_optimizer.pin_memory: expected "
    "true or false, got 1",
    'bf16.enabled="false"': "bf16.enabled: expected true or false, got 'false'",
    "csv_monitor.enabled=1": "csv_monitor.enabled: expected true or false, got 1",
    'timers.throughput.enabled="no"': "timers.throughput.enabled: expected true or false, got 'no'",
    # read by DeepSpeed with a default, not by pydantic: it failed on `'str' | 'bool'`, naming no key
    'wall_clock_breakdown="yes"': "wall_clock_breakdown: expected true or false, got 'yes'",
    'gradient_predivide_factor="2"': "gradient_predivide_factor: expected float, got '2'",
    'pipeline.use_reentrant="false"': "pipeline.use_reentrant: expected true or false, got 'false'",
    "pipeline.pipe_partitioned=0": "pipeline.pipe_partitioned: expected true or false, got 0",
}


@pytest.mark.parametrize("overrides", list(VALUES))
def test_a_bad_value_is_one_line_before_launch(tmp_path, capsys, monkeypatch, overrides):
    args = ["--config", str(write_config(tmp_path)), "--override", *overrides.split()]
    assert VALUES[overrides] in fail(capsys, args, monkeypatch=monkeypatch)
    assert not (tmp_path / "ckpt").exists()


def test_a_save_dir_that_is_a_file_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("mine")
    for save_dir, message in ((tmp_path / "afile", "is a file; choose a directory"),
                              (tmp_path / "afile" / "run", "is a file, so")):  # fmt: skip
        args = ["--config", str(write_config(tmp_path)), "--override", f"train.save_dir={save_dir}"]
        assert message in fail(capsys, args, monkeypatch=monkeypatch)
    assert (tmp_path / "afile").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
        "afile", "exp.json"]  # fmt: skip


@pytest.mark.slow
def test_a_save_dir_through_a_dangling_link_is_one_line(tmp_path):
    """A link to a directory that does not exist (an unmounted disk, a moved folder) said only `File exists`."""
    (tmp_path / "run").symlink_to(tmp_path / "unmounted" / "run")
    args = ["--config", str(write_config(tmp_path)), "--override", "train.max_steps=1"]
    for save_dir in (tmp_path / "run", tmp_path / "run" / "sub"):
        result = launch(ROOT / "scripts" / "train.py", *args, f"train.save_dir={save_dir}")
        errors = [line for line in (result.stdout + result.stderr).splitlines() if "fathom: error:" in line]
        assert result.returncode == 2 and errors == [
            f"fathom: error: train.save_dir: {tmp_path / 'run'} is a link to {tmp_path / 'unmounted' / 'run'}, "
            "which does not exist; create that directory, or remove the link"
        ], result.stdout[-2000:] + result.stderr[-2000:]
    assert not (tmp_path / "unmounted").exists()


def test_a_monitor_that_cannot_start_is_one_line(tmp_path, capsys, monkeypatch):
    """DeepSpeed imports a monitor's package and makes its output_path on every rank: a traceback each."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    (tmp_path / "afile").write_text("mine")
    for overrides, message in (
        (["wandb.enabled=true"], "wandb.enabled: needs the wandb package; pip install wandb, or disable it"),
        (["csv_monitor.enabled=true", f"csv_monitor.output_path={tmp_path / 'afile' / 'csv'}"],
         "csv_monitor.output_path: " + f"{tmp_path / 'afile'} is a file"),
    ):  # fmt: skip
        args = ["--config", str(write_config(tmp_path)), "--override", *overrides]
        assert message in fail(capsys, args, monkeypatch=monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "exp.json"]


def test_a_save_dir_in_use_or_holding_data_is_one_line(tmp_path, capsys, monkeypatch):
    """A second run in the same save_dir would interleave its checkpoints with the first's; a save_dir that
    is a prepared data directory would mix checkpoints into the data."""
    running = RunDirectory(tmp_path / "ckpt", rank=0)
    running.open()  # what a running job's rank 0 holds
    args = ["--config", str(write_config(tmp_path))]
    assert f"is in use by a running job (pid {os.getpid()} on" in fail(capsys, args, monkeypatch=monkeypatch)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / META_FILE).write_text("{}")
    args += ["--override", f"train.save_dir={tmp_path / 'data'}"]
    assert "is a prepared data directory; choose another" in fail(capsys, args, monkeypatch=monkeypatch)


def test_the_ranks_of_one_launch_ask_whether_the_save_dir_is_in_use_at_once(tmp_path):
    """Every rank checks the save_dir before the process group exists; the check took the lock exclusively for
    a moment, so a rank asking while another asked was told the save_dir `is in use by a running job` (a
    resume under load ended with exit 2). A check in progress no longer refuses another; a run still does."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / LOCK_FILE).write_text("pid 1 on an earlier job's host\n")
    asking = try_lock(tmp_path / "ckpt" / LOCK_FILE, shared=True)  # another rank's check, under way
    check_not_in_use(tmp_path / "ckpt")
    asking.close()
    running = RunDirectory(tmp_path / "ckpt", rank=0)
    running.open()
    with pytest.raises(ConfigError, match="is in use by a running job"):
        check_not_in_use(tmp_path / "ckpt")


def test_a_run_directory_is_removed_only_if_the_run_made_it_and_saved_nothing(tmp_path):
    made = RunDirectory(tmp_path / "new" / "run", rank=0)
    made.open()
    assert made.abandon() and not (tmp_path / "new").exists()  # its parent too: this run made both
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    found = RunDirectory(kept, rank=0)
    found.open()
    assert not found.abandon() and (kept / "notes.txt").exists()
    saved = RunDirectory(tmp_path / "saved", rank=0)
    saved.open()
    (saved.path / LATEST).write_text("global_step1")
    assert not saved.abandon() and saved.path.exists()
    # a best checkpoint without `latest` (validated before the first global_stepN, written before `latest`
    # named best checkpoints too) was deleted with the directory
    validated = RunDirectory(tmp_path / "validated", rank=0)
    validated.open()
    (validated.path / "best_global_step3").mkdir()
    (validated.path / "best").symlink_to("best_global_step3")
    assert not validated.abandon() and (validated.path / "best_global_step3").exists()


def test_a_failed_run_removes_only_what_holds_nothing_but_its_own_files(tmp_path):
    """Run A made p1/ for p1/expA, run B then saved checkpoints in p1/expB: A failing before its first
    checkpoint removed p1 whole, and B's run with it. Its own records go, then each directory it made
    that is left empty; one that holds anything else stays, with its parents."""
    stopped = RunDirectory(tmp_path / "p1" / "expA", rank=0)
    stopped.open()
    beside = RunDirectory(tmp_path / "p1" / "expB", rank=0)
    beside.open()
    (beside.path / METRICS_FILE).write_text('{"step": 1}\n')
    for run in (stopped, beside):
        (run.path / CONFIG_FILE).write_text("{}")
        (run.path / "global_step1").mkdir()  # a save that did not finish
        (run.path / "zero_to_fp32.py").write_text("")  # DeepSpeed copies it in as it saves
    (beside.path / "global_step1" / MANIFEST).write_text("{}")  # B's finished
    (beside.path / LATEST).write_text("global_step1")
    kept = snapshot(tmp_path / "p1" / "expB")
    removed = stopped.abandon()
    assert (tmp_path / "p1" / "expB").exists() and snapshot(tmp_path / "p1" / "expB") == kept
    assert removed == stopped.path.absolute() and not removed.exists()
    # something put into the run's directory while it ran is not the run's: it stays, the records go
    visited = RunDirectory(tmp_path / "p2" / "run", rank=0)
    visited.open()
    (visited.path / CONFIG_FILE).write_text("{}")
    (visited.path / "notes.txt").write_text("mine")
    assert visited.abandon() is None and [p.name for p in visited.path.iterdir()] == ["notes.txt"]


def test_a_run_that_logged_a_step_keeps_its_directory(tmp_path):
    """A run stopped before its first checkpoint removed its save_dir, metrics.jsonl with 50 logged steps
    included: the record of work done goes only with a run that trained nothing."""
    run = RunDirectory(tmp_path / "run", rank=0)
    run.open()
    (run.path / CONFIG_FILE).write_text("{}")
    (run.path / METRICS_FILE).write_text('{"step": 1}\n')
    kept = snapshot(tmp_path / "run")
    assert run.abandon() is None and snapshot(tmp_path / "run") == kept


@pytest.mark.parametrize("override", list(TYPOS))
def test_a_typo_at_any_level_is_one_line(tmp_path, capsys, monkeypatch, override):
    err = fail(capsys, ["--config", str(write_config(tmp_path)), "--override", override], monkeypatch=monkeypatch)
    assert TYPOS[override] in err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("mutate, message", CASES, ids=[c[1].split(":")[0] for c in CASES])
def test_bad_config_is_one_line(tmp_path, capsys, monkeypatch, mutate, message):
    err = fail(capsys, ["--config", str(write_config(tmp_path, mutate))], monkeypatch=monkeypatch)
    assert message in err
    assert not (tmp_path / "ckpt").exists()


def test_world_size_not_divisible_by_stages(tmp_path, capsys, monkeypatch):
    err = fail(capsys, ["--config", str(write_config(tmp_path))], world_size=3, monkeypatch=monkeypatch)
    assert "3 processes cannot be split into 2 stages" in err


def test_malformed_json(tmp_path, capsys, monkeypatch):
    err = fail(capsys, ["--config", str(write_config(tmp_path, text='{"model": {,}}'))], monkeypatch=monkeypatch)
    assert "invalid JSON at line 1 column 12" in err


def test_a_config_with_a_bom_loads_and_one_not_utf8_is_one_line(tmp_path, capsys, monkeypatch):
    """A BOM (Windows editors) was refused as invalid JSON; Latin-1 text was a UnicodeDecodeError traceback."""
    path = write_config(tmp_path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert (
        load_config(path, world_size=None).model.encoder_layers
        == json.loads(DEFAULT.read_text())["model"]["encoder_layers"]
    )
    path.write_bytes(path.read_bytes()[3:].replace(b'"model"', b'"mod\xe9l"', 1))
    assert "exp.json: not UTF-8 text (byte" in fail(capsys, ["--config", str(path)], monkeypatch=monkeypatch)


def test_a_key_twice_in_one_object_is_one_line(tmp_path, capsys, monkeypatch):
    """json keeps the last of two equal keys silently: which depth trained depended on the order."""
    text = DEFAULT.read_text().replace('"encoder_layers": 12,', '"encoder_layers": 12, "encoder_layers": 2,')
    err = fail(capsys, ["--config", str(write_config(tmp_path, text=text))], monkeypatch=monkeypatch)
    assert "exp.json: key 'encoder_layers' appears twice in one object; keep one" in err
    args = ["--config", str(write_config(tmp_path)), "--override", 'model.branchnorm={"T": 5, "T": 6}']
    assert "key 'T' appears twice in one object" in fail(capsys, args, monkeypatch=monkeypatch)


@pytest.mark.parametrize("override", ["model.encoder_layers", "=5", ".model=3", "model..x=1"])
def test_bad_override(tmp_path, capsys, monkeypatch, override):
    args = ["--config", str(write_config(tmp_path)), "--override", override]
    assert f"--override '{override}': expected dotted.key=value" in fail(capsys, args, monkeypatch=monkeypatch)
    args = ["--config", str(write_config(tmp_path)), "--override", "model.ffn_dims=3"]
    assert "model.ffn_dims: unknown key; did you mean 'ffn_dim'?" in fail(capsys, args, monkeypatch=monkeypatch)


def test_existing_checkpoints_need_resume(tmp_path, capsys, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("global_step5")
    err = fail(capsys, ["--config", str(write_config(tmp_path))], monkeypatch=monkeypatch)
    assert "already holds checkpoints; pass --resume" in err


def test_overrides_take_dotted_keys_and_json_values(tmp_path):
    cfg = load_config(
        write_config(tmp_path),
        ["model.encoder_layers=24", "model.branchnorm.growth=sigmoid", "train.save_dir=/x", "pipeline.stages=4"],
        world_size=4,
    )
    assert cfg.model.encoder_layers == 24 and cfg.stages == 4 and cfg.train.save_dir == "/x"
    assert cfg.model.schemes["branchnorm"] == {"T": 100, "growth": "sigmoid"}


@pytest.mark.slow
def test_the_launcher_exits_nonzero_on_a_bad_config(tmp_path):
    path = write_config(tmp_path, set_key(["model", "decoder_layer"], 2))
    result = deepspeed_launch(ROOT / "scripts" / "train.py", "--config", str(path))
    assert result.returncode != 0
    assert "fathom: error: model.decoder_layer: unknown key" in result.stderr + result.stdout


@pytest.mark.slow
def test_a_port_in_use_is_one_line_and_leaves_no_save_dir(tmp_path):
    """Two jobs on one machine on one port (the launcher's default is 29500 for every job): every rank of
    the second printed a DistNetworkError traceback."""
    path = write_config(tmp_path, set_key(["train", "max_steps"], 1))
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [shutil.which("deepspeed"), "--num_gpus", "2", "--master_port", str(port), "scripts/train.py"]
        result = subprocess.run([*command, "--config", str(path)], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)  # fmt: skip
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "fathom: error:" in line]
    assert result.returncode != 0 and len(errors) == 1, output[-3000:]
    assert f"port {port} is in use on this machine (another run?); pass the launcher --master_port N" in errors[0]
    assert "Traceback" not in output and not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_plain_python_exits_2_with_one_line(tmp_path):
    path = write_config(tmp_path, set_key(["pipeline", "stages"], 99))
    result = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", str(path)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("fathom: error: pipeline.stages: 99 stages")
    assert len(result.stderr.strip().splitlines()) == 1


def test_init_from_must_describe_the_same_model(tmp_path, capsys, monkeypatch):
    source = tmp_path / "source"
    (source / "fairseq").mkdir(parents=True)
    (source / "latest").write_text("fairseq")
    model = {**json.loads(DEFAULT.read_text())["model"], "src_vocab_size": 20, "tgt_vocab_size": 20}
    (source / "config.json").write_text(json.dumps({"model": {**model, "encoder_layers": 6}}))
    args = ["--config", str(write_config(tmp_path)), "--override", f"train.init_from={source}"]
    err = fail(capsys, args, monkeypatch=monkeypatch)
    assert "train.init_from: model.encoder_layers is 6 in" in err and "must describe the same model" in err
    (source / "config.json").write_text(json.dumps({"model": {**model, "norm_scheme": "post_ln"}}))
    err = fail(capsys, args, monkeypatch=monkeypatch)  # weights of another scheme mean something else
    assert "train.init_from: model.norm_scheme is post_ln in" in err and "but branchnorm here" in err
    (source / "config.json").write_text(json.dumps({"model": model}))
    err = fail(capsys, args, monkeypatch=monkeypatch)
    assert "layer files missing (first layer_00-model_states.pt)" in err


def test_bf16_on_a_cpu_that_emulates_it_is_one_warning_line(tmp_path, monkeypatch):
    """A CPU without avx512_bf16 or amx_bf16 emulates bf16 matrix products about 50x slower than fp32: a
    run asking for bf16 there is told so in one line at start-up instead of silently crawling."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse2 avx2 avx512f avx512bw\n")
    assert not machine.native_bf16_cpu(cpuinfo)
    cpuinfo.write_text("processor : 0\nflags : fpu sse2 avx2 avx512f avx512_bf16\n")
    assert machine.native_bf16_cpu(cpuinfo)
    monkeypatch.setattr(deepspeed_values, "native_bf16_cpu", lambda: False)
    warning = deepspeed_values.precision_warning({"bf16": {"enabled": True}})
    assert warning is not None and "\n" not in warning and "bf16.enabled=false" in warning
    assert deepspeed_values.precision_warning({"bf16": {"enabled": False}}) is None
    monkeypatch.setattr(deepspeed_values, "native_bf16_cpu", lambda: True)
    assert deepspeed_values.precision_warning({"bf16": {"enabled": True}}) is None


def test_each_choice_a_config_type_names_has_an_implementation():
    """Choices are checked from the field's Literal type; each must be one the code can run."""
    heaps = typing.get_type_hints(TrainConfig)["cpu_heap"]
    assert set(typing.get_args(heaps)) == set(CPU_HEAPS)
    assert set(typing.get_args(typing.get_type_hints(BranchNorm.Options)["growth"])) == set(GROWTH)
    assert set(typing.get_args(typing.get_type_hints(DeepNorm.Options)["init"])) == set(DEEPNORM_INITS)


def test_every_decoder_searches_with_the_same_settings():
    """generate.py, translate.py, train.valid_bleu and the depth study read one search config: same keys,
    same defaults (the study's lenpen is its own choice), one validator."""
    from fathom.translation.decoding_flags import search_config
    from fathom.translation.generate import parse_args

    args = parse_args(["--checkpoint", "run", "--data", "data"])
    assert search_config(args) == SearchConfig()
    assert dataclasses.asdict(ValidBleu()) == {**dataclasses.asdict(SearchConfig()), "sentences": 0}
    args.max_len_a = float("nan")
    with pytest.raises(ConfigError, match="--max-len-a: must be a finite number, got nan"):
        search_config(args)
    with pytest.raises(ConfigError, match="train.valid_bleu.max_len_a: must be a finite number, got nan"):
        parse_section(ValidBleu, {"max_len_a": float("nan")}, "train.valid_bleu")


def test_a_copied_run_directory_is_no_change_of_settings(tmp_path):
    """A run copied elsewhere and resumed there printed `train.save_dir old -> new` as a change of its
    settings and started a new stretch in config_history.jsonl."""
    config = load_config(DEFAULT, world_size=None).to_dict()
    original, copy = tmp_path / "run", tmp_path / "copy"
    original.mkdir()
    record_config(original, {**config, "train": {**config["train"], "save_dir": str(original)}}, 0)
    shutil.copytree(original, copy)
    moved = {**config, "train": {**config["train"], "save_dir": str(copy)}}
    assert record_config(copy, moved, 100) == []
    assert [r["from_step"] for r in read_jsonl(copy / CONFIG_HISTORY)] == [0]
    assert json.loads((copy / "config.json").read_text())["train"]["save_dir"] == str(copy)
    longer = {**moved, "train": {**moved["train"], "max_steps": 800}}
    assert record_config(copy, longer, 200) == ["train.max_steps 400 -> 800"]
    assert [r["from_step"] for r in read_jsonl(copy / CONFIG_HISTORY)] == [0, 200]


def test_a_bare_name_finds_the_shipped_config_past_a_directory_and_an_explicit_path_never_falls_back(
    tmp_path, capsys, monkeypatch
):
    """A directory named `default` where the command ran made `--config default` fail (`Is a directory`)
    instead of reading the shipped config, while `--config ./default` with no such file silently trained the
    shipped one. A bare name finds a shipped config where no file of that name exists (a directory is
    none); a path with a / or a leading . is read as written, or refused in one line."""
    from pathlib import Path

    from fathom.pipeline.config.config_file import config_file

    monkeypatch.chdir(tmp_path)
    shipped = config_file("default")
    assert shipped.is_file() and shipped.parent.name == "ds_configs"
    for explicit in ("./default", "./default.json", "sub/default", ".default"):
        assert config_file(explicit) == Path(explicit) != shipped
    assert "default: no such config" in fail(capsys, ["--config", "./default"], monkeypatch=monkeypatch)
    (tmp_path / "default").mkdir()
    assert config_file("default") == shipped
    assert load_config("default", world_size=None).model == load_config(DEFAULT, world_size=None).model
    assert "cannot read the config (Is a directory)" in fail(capsys, ["--config", "./default"], monkeypatch=monkeypatch)
    assert list(tmp_path.iterdir()) == [tmp_path / "default"]


def test_a_config_whose_data_is_not_prepared_reads_and_its_data_is_refused_where_it_is_read(tmp_path):
    """DataConfig read the disk when a config was parsed, so the planner had to override data.path=null to plan a
    recipe before its data exists: the config now reads without the data, and the data is refused, in the same
    line, where it is read."""
    from pathlib import Path

    from fathom.pipeline.config.run_config import DataNotPreparedError, load_config
    from fathom.pipeline.config.run_data import build_corpus

    cfg = load_config("branchnorm_table2_wmt14_en_fr_6L-6L", ["model.src_vocab_size=40008",
                      "model.tgt_vocab_size=40008"], world_size=None)  # fmt: skip
    assert cfg.data.path and not (Path(cfg.data.path) / META_FILE).exists()
    with pytest.raises(DataNotPreparedError, match=r"is not a prepared data directory; run scripts/prepare_data.py"):
        build_corpus(cfg)
