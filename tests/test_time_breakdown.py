"""train.time_breakdown: each pipeline instruction's time per step and rank, logged and summed up."""

import pytest

from fathom.common.jsonl import read_jsonl
from fathom.common.run_layout import TIME_BREAKDOWN_FILE
from tests.helpers import ROOT, launch

STEPS = 5


@pytest.mark.slow
def test_a_two_stage_run_logs_where_each_ranks_step_went(tmp_path):
    """Every step has both ranks' times; each stage spends time in exactly the instructions its place
    in the pipeline gives it (stage 0 sends activations and receives gradients, stage 1 the reverse),
    those times fit inside the step, and the run ends with one summary line per rank."""
    overrides = ["model.encoder_layers=2", "model.decoder_layers=2", f"train.max_steps={STEPS}",
                 f"train.save_dir={tmp_path}", "train.save_interval=1000", "train.time_breakdown=true"]  # fmt: skip
    result = launch(ROOT / "scripts" / "train.py", "--config", str(ROOT / "ds_configs" / "default.json"),
                    "--override", *overrides)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(tmp_path / TIME_BREAKDOWN_FILE)
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    sends = {0: ("send_activation", "recv_grad"), 1: ("recv_activation", "send_grad")}
    for record in records:
        assert [(r["rank"], r["stage"]) for r in record["ms"]] == [(0, 0), (1, 1)]
        for ms in record["ms"]:
            mine, others = sends[ms["stage"]], sends[1 - ms["stage"]]
            assert all(ms[key] > 0 for key in ("forward_pass", "backward_pass", "optimizer_step", *mine)), ms
            assert all(ms[key] == 0 for key in others), ms
            instructions = sum(value for key, value in ms.items() if key not in ("rank", "stage", "step"))
            assert 0 < instructions <= ms["step"], ms
    summary = [line for line in result.stdout.splitlines() if line.startswith("fathom:   rank ")]
    assert [line.split(":")[1].strip() for line in summary] == ["rank 0 (stage 0)", "rank 1 (stage 1)"]
    assert "where a step's time went, mean ms per step of steps 4-5" in result.stdout
