"""fathom's InverseSqrtLR (pipeline/config/inverse_sqrt.py): fairseq's inverse_sqrt rates, update by
update, in a config DeepSpeed accepts, and through a kill and a resume."""

import json
import math

import pytest
import torch

from fathom.common.errors import ConfigError
from fathom.pipeline.config.deepspeed_arguments import check_constructor_args
from fathom.pipeline.config.engine_defaults import engine_config
from fathom.pipeline.config.inverse_sqrt import InverseSqrtLR, client_scheduler
from tests.helpers import ROOT, assert_same_training, launch, logged_steps

WARMUP, FIRST, PEAK = 4, 1e-7, 5e-4
SCHEDULER = {
    "type": "InverseSqrtLR",
    "params": {"warmup_min_lr": FIRST, "warmup_max_lr": PEAK, "warmup_num_steps": WARMUP},
}


def fairseqs_rate(num_updates: int) -> float:
    """fairseq's inverse_sqrt after `num_updates` updates (fairseq/optim/lr_scheduler/inverse_square_root_schedule.py,
    written out): warmup_init_lr + num_updates * lr_step in the warmup, then decay_factor / sqrt(num_updates)."""
    if num_updates < WARMUP:
        return FIRST + num_updates * (PEAK - FIRST) / WARMUP
    return PEAK * math.sqrt(WARMUP) / math.sqrt(num_updates)


def test_each_update_applies_fairseqs_rate():
    """Update u (from 1) applies fairseq's rate after u - 1 updates, as DeepSpeed's engine steps it: built,
    then stepped once after each update."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = client_scheduler({"scheduler": SCHEDULER})(optimizer)
    applied = []
    for _ in range(12):
        applied.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    assert applied == pytest.approx([fairseqs_rate(u - 1) for u in range(1, 13)], rel=1e-12)
    assert applied[WARMUP] == PEAK and applied[0] == FIRST


def test_a_resumed_scheduler_applies_the_rate_of_the_update_it_resumes_at():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed = InverseSqrtLR(optimizer, FIRST, PEAK, WARMUP)
    resumed.load_state_dict({"last_batch_iteration": 8})  # 9 updates done
    resumed.step(resumed.last_batch_iteration)  # what fathom does after DeepSpeed's load
    assert optimizer.param_groups[0]["lr"] == pytest.approx(fairseqs_rate(9), rel=1e-12)


def test_deepspeed_receives_it_built_and_not_in_its_config():
    ds = {"train_batch_size": 8, "scheduler": SCHEDULER}
    assert "scheduler" not in engine_config(ds) and ds["scheduler"] == SCHEDULER
    assert client_scheduler({"scheduler": {"type": "WarmupLR", "params": {}}}) is None


@pytest.mark.parametrize(
    "scheduler, error",
    [
        (
            {"type": "InverseSqrtLR", "params": {"warmup_type": "linear"}},
            "scheduler.params.warmup_type: not an argument of InverseSqrtLR",
        ),
        ({"type": "InverseSqrtLR", "params": {"warmup_num_steps": "4000"}}, "scheduler.params.warmup_num_steps"),
        (
            {"type": "InverseSqrt", "params": {}},
            "scheduler.type: 'InverseSqrt' is neither DeepSpeed's scheduler nor fathom's; use one of",
        ),
    ],
)
def test_a_wrong_scheduler_is_one_line(scheduler, error):
    with pytest.raises(ConfigError) as err:
        check_constructor_args({"scheduler": scheduler})
    assert str(err.value).startswith(error) and "\n" not in str(err.value)


@pytest.mark.slow
def test_a_run_applies_fairseqs_rates_and_resumes_on_them(tmp_path):
    """The default job with InverseSqrtLR: each logged step's rate is fairseq's, and a run cut at step 3
    and resumed trains exactly as one never cut (past the warmup, where the rate decays)."""
    common = ["model.encoder_layers=2", "model.decoder_layers=2", "train.save_interval=3", "train.log_interval=1",
              f"scheduler={json.dumps(SCHEDULER)}"]  # fmt: skip

    def train(save_dir, steps, *resume):
        args = ["--config", str(ROOT / "ds_configs" / "default.json"), *resume, "--override", *common]
        job = launch(ROOT / "scripts" / "train.py", *args, f"train.max_steps={steps}", f"train.save_dir={save_dir}")
        assert job.returncode == 0

    full, cut = tmp_path / "full", tmp_path / "cut"
    train(full, 8)
    train(cut, 3)
    train(cut, 8, "--resume")
    assert_same_training(full, cut)
    rates = [step["lr"] for step in logged_steps(full) if "lr" in step]
    assert rates == pytest.approx([fairseqs_rate(u - 1) for u in range(1, 9)], rel=1e-9)


DEFAULT = ROOT / "ds_configs" / "default.json"
TOTAL = {"total_num_steps": 400, "warmup_num_steps": 10}  # the default job's train.max_steps: check_schedule passes
NEGATIVE_RATES = [
    ("InverseSqrtLR", {"warmup_min_lr": -0.01, "warmup_max_lr": -0.01, "warmup_num_steps": 1}, "warmup_min_lr"),
    ("InverseSqrtLR", {"warmup_max_lr": -0.01}, "warmup_max_lr"),
    ("WarmupLR", {"warmup_max_lr": -0.001}, "warmup_max_lr"),
    ("WarmupLR", {"warmup_min_lr": -1e-5, "warmup_max_lr": 0.001}, "warmup_min_lr"),
    ("WarmupDecayLR", {**TOTAL, "warmup_max_lr": -0.001}, "warmup_max_lr"),
    ("WarmupCosineLR", {**TOTAL, "warmup_min_ratio": -0.5}, "warmup_min_ratio"),
    ("WarmupCosineLR", {**TOTAL, "cos_min_ratio": -0.5}, "cos_min_ratio"),
    ("OneCycle", {"cycle_min_lr": -0.001, "cycle_max_lr": 0.01}, "cycle_min_lr"),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": [-0.01]}, "cycle_max_lr"),  # one rate per param group
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 0.01, "decay_lr_rate": -0.5}, "decay_lr_rate"),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 0.01, "cycle_min_mom": -0.8}, "cycle_min_mom"),
    ("LRRangeTest", {"lr_range_test_min_lr": -0.001}, "lr_range_test_min_lr"),
    ("LRRangeTest", {"lr_range_test_step_rate": -1.0}, "lr_range_test_step_rate"),
]


def load_with_scheduler(name: str, params: dict):
    """The default job's config through the config loader, its scheduler replaced as --override would."""
    from fathom.pipeline.config.run_config import load_config

    return load_config(DEFAULT, [f"scheduler={json.dumps({'type': name, 'params': params})}"], world_size=None)


@pytest.mark.parametrize("name, params, key", NEGATIVE_RATES, ids=[f"{c[0]}-{c[2]}" for c in NEGATIVE_RATES])
def test_a_negative_rate_of_any_scheduler_is_one_line_naming_the_key(name, params, key):
    """A negative rate given through the scheduler trained by gradient ascent (InverseSqrtLR at -0.01: the
    loss climbed 3.45 -> 4.89, exit 0), where optimizer.params.lr=-0.001 was refused: every rate, ratio and
    momentum of every scheduler fathom accepts is refused below 0, naming its key."""
    with pytest.raises(ConfigError) as err:
        load_with_scheduler(name, params)
    assert str(err.value).startswith(f"scheduler.params.{key}: ") and "\n" not in str(err.value)
    assert "negative" in str(err.value) and ">= 0" in str(err.value)


@pytest.mark.parametrize("steps", [0, -3, 2.5])
@pytest.mark.parametrize("name", ["InverseSqrtLR", "WarmupLR"])
def test_a_warmup_that_is_no_count_of_steps_is_one_line_naming_the_key(name, steps):
    """InverseSqrtLR's warmup_num_steps 0 or -3 ended in `scheduler.params: division by zero`, naming no
    key, and 2.5 was taken as a step count; it is refused as DeepSpeed's WarmupLR refuses it."""
    with pytest.raises(ConfigError) as err:
        load_with_scheduler(name, {"warmup_num_steps": steps})
    assert str(err.value) == f"scheduler.params: warmup_num_steps must be a positive integer, got {steps}"


def test_zero_and_positive_rates_still_load():
    """What the refusals leave alone: a warmup from 0, the papers' InverseSqrtLR, OneCycle's defaults."""
    load_with_scheduler("InverseSqrtLR", {"warmup_min_lr": 0, "warmup_max_lr": 5e-4, "warmup_num_steps": 1})
    load_with_scheduler("WarmupCosineLR", {**TOTAL, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0})
    load_with_scheduler("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": [0.01]})
