"""The cluster plan (planner/cluster_plan.py): its splits, bubble and traffic against DeepSpeed's own schedule
and 2-, 3- and 4-stage runs, and the plan a user gets for a paper's recipe."""

import json

import pytest
from deepspeed.runtime.pipe import schedule

from fathom.pipeline.config.run_config import load_config
from fathom.pipeline.parts.activation_trace import trace_layers
from fathom.pipeline.parts.stage_memory import MicroBatchShape
from fathom.pipeline.reports.memory import GiB
from fathom.planner.cluster import Cluster, crossings
from fathom.planner.cluster_plan import Split, main, plan_split
from fathom.planner.estimate import fill_vocab_and_length
from fathom.planner.layer_times import LayerTime, time_layers
from tests.helpers import ROOT, launch

DEFAULT = ROOT / "ds_configs" / "default.json"
SMALL = [
    "model.encoder_layers=2", "model.decoder_layers=2", "model.embed_dim=16", "model.ffn_dim=32",
    "model.attention_heads=2", "model.share_all_embeddings=true", "pipeline.activation_checkpoint_interval=1",
    "data.synthetic.min_len=5", "data.synthetic.max_len=5",  # every pair 6 tokens with eos: one shape
    "train_micro_batch_size_per_gpu=3", "train_batch_size=12",
]  # fmt: skip
RECIPE = "branchnorm_table2_wmt14_en_fr_500L-500L"


def small(stages: int, replicas: int):
    overrides = [*SMALL, f"gradient_accumulation_steps={12 // (3 * replicas)}", f"pipeline.stages={stages}"]
    cfg = load_config(DEFAULT, overrides, world_size=stages * replicas)
    fill_vocab_and_length(cfg, 6)
    return cfg, overrides


@pytest.mark.parametrize("stages", [2, 3, 4, 7])
@pytest.mark.parametrize("micro_batches", [1, 3, 16])
def test_bubble_is_the_idle_share_of_deepspeeds_schedule(stages, micro_batches):
    """Every stage of DeepSpeed's TrainSchedule idles in the same share of its slots as the plan says."""
    cfg = load_config(DEFAULT, [f"gradient_accumulation_steps={micro_batches}", "train_micro_batch_size_per_gpu=1",
                                f"train_batch_size={micro_batches}"], world_size=None)  # fmt: skip
    fill_vocab_and_length(cfg, 6)
    plan = plan_split(cfg, trace_layers(cfg, 6), MicroBatchShape(1, 6), Split(stages, 1, 0))
    for stage in range(stages):
        slots = list(schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage).steps())
        busy = sum(any(isinstance(c, (schedule.ForwardPass, schedule.BackwardPass)) for c in cmds) for cmds in slots)
        assert 1 - busy / len(slots) == pytest.approx(plan.bubble)


@pytest.mark.slow
@pytest.mark.parametrize("stages, replicas", [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_bytes_sent_and_bubble_match_a_run(tmp_path, stages, replicas):
    """Every rank of a gloo run sends, in each of its steps, exactly the bytes the plan gives its stage
    (outputs and shapes forward, gradients back), and its schedule idles in the plan's share of slots."""
    cfg, overrides = small(stages, replicas)
    plan = plan_split(cfg, trace_layers(cfg, 6), MicroBatchShape(3, 6), Split(stages, replicas, 1))
    overrides += ["train.max_steps=2", "train.save_interval=100"]
    job = launch("tests/workers/pipeline_traffic.py", str(DEFAULT), str(tmp_path), *overrides,
                 processes=stages * replicas)  # fmt: skip
    assert job.returncode == 0
    for rank in range(stages * replicas):
        stage = rank // replicas  # DeepSpeed's grid: a stage's replicas are adjacent ranks
        expected = (plan.forward_bytes[stage] if stage < stages - 1 else 0) + (
            plan.backward_bytes[stage - 1] if stage else 0
        )
        steps = json.loads((tmp_path / f"traffic-{rank}.json").read_text())
        assert list(steps) == ["1", "2"]
        for step in steps.values():
            assert step["sent"] == expected
            assert (step["slots"] - step["busy"]) / step["slots"] == pytest.approx(plan.bubble)


def test_the_shared_embedding_is_all_reduced_among_its_stages_only():
    """Tables of 20 x 16 fp32: all-reduced once stages part them, and among replicas each stage's gradients."""
    (cfg, _), (cfg_replicated, _) = small(1, 1), small(2, 2)
    one = plan_split(cfg, trace_layers(cfg, 6), MicroBatchShape(3, 6), Split(1, 1, 1))
    two = plan_split(cfg_replicated, trace_layers(cfg_replicated, 6), MicroBatchShape(3, 6), Split(2, 2, 1))
    assert one.tied_reduce == 0 and one.replica_reduce == [0]
    assert two.tied_reduce == 20 * 16 * 4
    assert two.replica_reduce == [estimate.params * 4 for estimate in two.estimates]


@pytest.mark.parametrize("interval", [0, 1])
def test_step_time_is_the_critical_path_of_layer_times(interval):
    """On one stage, 4 micro-batches of every spec's forward (1 s) and backward (2 s), and with checkpointing
    each Transformer layer's forward again; on two, the slower stage's, for 4 + 1 slots."""
    cfg, _ = small(1, 1)
    traces = trace_layers(cfg, 6)
    times = [LayerTime(1.0, 2.0)] * len(traces[0])
    one = plan_split(cfg, traces, MicroBatchShape(3, 6), Split(1, 1, interval), times)
    assert one.step_seconds == 4 * (3 * len(times) + interval * 4)
    two = plan_split(cfg, traces, MicroBatchShape(3, 6), Split(2, 1, interval), times)
    slowest = max(3 * (e.stop - e.start) + interval * sum(t.checkpointable for t in traces[0][e.start : e.stop])
                  for e in two.estimates)  # fmt: skip
    assert two.step_seconds == 5 * slowest


def test_layer_times_are_measured_for_every_spec():
    cfg, _ = small(1, 1)
    times = time_layers(cfg, 3, 6, repeats=1)
    assert len(times) == len(trace_layers(cfg, 6)[0])
    assert all(t.forward > 0 and t.backward > 0 for t in times)


def test_a_replica_count_must_split_the_batch():
    """Refused as a launch on that many replicas would be: the config check's own line."""
    shrunk = ["data.path=null", "model.src_vocab_size=8", "model.tgt_vocab_size=8", "model.encoder_layers=2",
              "model.decoder_layers=2"]  # fmt: skip
    cfg = load_config(RECIPE, shrunk, world_size=None)  # 128 micro-batches of 1 an update
    traces = trace_layers(cfg, 6)
    assert plan_split(cfg, traces, MicroBatchShape(1, 6), Split(1, 8, 1)).micro_batches == 16
    assert plan_split(cfg, traces, MicroBatchShape(1, 6), Split(1, 3, 1)) == (
        "train_batch_size: 128 is not a multiple of train_micro_batch_size_per_gpu 1 x 3 data-parallel ranks"
    )
    fixed = load_config(DEFAULT, [], world_size=None)  # train_batch_size 32 = 8 x gradient_accumulation_steps 4
    fill_vocab_and_length(fixed, 6)
    refused = plan_split(fixed, trace_layers(fixed, 6), MicroBatchShape(8, 6), Split(1, 2, 0))
    assert refused.startswith("train_batch_size: 32 != train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps")


def test_node_crossings_follow_deepspeeds_rank_grid():
    """Two nodes of 4: stage s, replica d is rank 4s + d (2 x 4) or 2s + d (4 x 2)."""
    cluster = Cluster(8, [4, 4], 80 * GiB)
    assert crossings(cluster, 2, 4) == ([True], [False, False])
    assert crossings(cluster, 4, 2) == ([False, True, False], [False] * 4)
    assert crossings(cluster, 1, 8) == ([], [True])


def test_the_papers_500_layers_on_8_gpus(capsys):
    """BranchNorm's 500L-500L En-Fr before its data exists: every split of 8 GPUs of 80 GB, the plan stage by
    stage, and the command that launches it."""
    main(["--config", RECIPE, "--gpus", "8", "--gpu-memory", "80GB", "--vocab-size", "40008", "--stages", "2"])
    out = capsys.readouterr().out
    assert "3,698,692,096 parameters; 8 GPUs (1 node of 8), 74.51 GiB each" in out
    assert "micro-batches of at most 15 x 257 tokens" in out  # 4,096 tokens of prepare_data's longest pairs
    assert " 2 x 4    1    32" in out  # 128 micro-batches an update, 32 for each of 4 replicas
    assert "1F1B bubble: 1 of 33 slots idle on every stage (3.0%)" in out
    assert "stage 0 -> 1:" in out and "(within a node)" in out
    assert f"--config {RECIPE} --override pipeline.stages=2" in out


def test_a_step_time_from_layers_timed_here(capsys):
    main(["--config", str(DEFAULT), "--gpus", "2", "--gpu-memory", "8GB", "--time-layers", "--override",
          "model.encoder_layers=2", "model.decoder_layers=2"])  # fmt: skip
    out = capsys.readouterr().out
    assert "step s" in out and "from per-layer times measured on CPU" in out


def test_a_plan_from_a_hostfile(tmp_path, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=4\nnode-b slots=4\n")
    main(["--config", RECIPE, "--hostfile", str(hostfile), "--gpu-memory", "80GB", "--vocab-size", "40008",
          "--stages", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert "8 GPUs (2 nodes of 4)" in out and "stage 0 -> 1:" in out and "(across nodes)" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "2", "--gpu-memory", "16GB", "--vocab-size", "40008"], "no split of 2 GPUs holds this run"),
        (["--gpus", "64", "--gpu-memory", "80GB"], "not a prepared data directory; run scripts/prepare_data.py; or "
         "plan without it: --vocab-size V [--length L]"),
        (["--gpus", "8", "--gpu-memory", "80GB", "--vocab-size", "40008", "--stages", "3"],
         "--stages 3: not a divisor"),
        (["--gpus", "6", "--gpu-memory", "80GB", "--vocab-size", "40008", "--stages", "2"],
         "--stages 2: train_batch_size: 128 is not a multiple of train_micro_batch_size_per_gpu 1 x 3 data-parallel "
         "ranks"),
        (["--gpus", "8", "--gpu-memory", "eighty", "--vocab-size", "40008"], "expected a size like 80GB"),
    ],
)  # fmt: skip
def test_a_plan_that_cannot_be_is_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["--config", RECIPE, *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
