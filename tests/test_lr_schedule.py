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
