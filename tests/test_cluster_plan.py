"""The cluster plan (planner/cluster_plan.py): its splits, bubble and traffic against DeepSpeed's own schedule
and 2-, 3- and 4-stage runs, and the plan a user gets for a paper's recipe."""

import json
import os
import platform
import re
import shlex
import subprocess
import sys

import pytest
import torch
from deepspeed.runtime.pipe import schedule

from fathom.common.machine import available_memory, cpu_name
from fathom.common.sizes import GiB
from fathom.pipeline.config.run_config import load_config
from fathom.pipeline.parts.activation_trace import trace_layers
from fathom.pipeline.parts.stage_memory import MicroBatchShape
from fathom.planner import layer_times
from fathom.planner.cluster import Cluster, crossings
from fathom.planner.cluster_plan import Split, main, plan_split
from fathom.planner.estimate import fill_vocab_and_length
from fathom.planner.layer_times import LayerTime, time_layers
from tests.helpers import ROOT, free_port, launch

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
    assert f"--config {RECIPE} --override pipeline.stages=2 --resume" in out


def test_every_stage_holds_the_fixed_part_and_fits_with_it(capsys):
    """A 2-stage 2L-2L plan said 0.003 GiB a stage, where each rank of the run held 0.06 GiB above its baseline,
    and "fits" compared that with all of the GPU's memory. Now each stage's peak has the fixed part (the CUDA
    context, NCCL's buffers, the allocator's reserve: --reserve, 2 GiB by default on a GPU) in a column of its
    own, and a GPU fits a split only with it."""
    args = ["--config", str(DEFAULT), "--gpus", "2", "--override", *SMALL, "--stages", "2"]
    main([*args, "--gpu-memory", "8GB"])
    out = capsys.readouterr().out
    stage = next(line.split() for line in out.splitlines() if line.strip().startswith("0 "))
    assert stage[3] == stage[-1] == "2.00", out  # fixed, peak GiB: the model of 2L-2L d 16 is a few MiB
    with pytest.raises(SystemExit):
        main([*args, "--gpu-memory", "2GiB"])
    assert "and the others need more than 2.00 GiB" in capsys.readouterr().err
    main([*args, "--gpu-memory", "2GiB", "--reserve", "100MiB"])
    stage = next(line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("0 "))
    assert stage[3] == stage[-1] == "0.10"


def launch_line(out: str) -> list[str]:
    return shlex.split(next(line for line in out.splitlines() if line.startswith("launch: "))[len("launch: ") :])


def test_the_launch_line_carries_the_plans_overrides_and_its_cluster(tmp_path, capsys):
    """The launch line dropped the plan's --override values (planned in bf16 at 2L-6L, it launched fp32 6L-6L),
    said `--hostfile HOSTFILE` for GPUs counted by --gpus and `scripts/train.py`, which a wheel lacks. Now it
    has every override the plan was made with, the plan's stages in place of the user's, the hostfile planned
    with (or --num_gpus on one node; several nodes counted by --gpus say what HOSTFILE stands for), and the
    installed module."""
    recipe = "branchnorm_table2_wmt14_en_fr_6L-6L"
    given = ['bf16={"enabled": true}', "model.encoder_layers=2", "pipeline.stages=3"]
    common = ["--config", recipe, "--gpu-memory", "80GB", "--vocab-size", "40008", "--override", *given]
    main([*common, "--gpus", "8", "--stages", "2"])
    out = capsys.readouterr().out
    assert "bf16, ZeRO stage 1, 2 stages x 4 data-parallel" in out
    assert launch_line(out) == ["fathom-launch", "--num_gpus", "8", "--module", "fathom.train", "--config", recipe,
                                "--override", *given[:2], "pipeline.stages=2", "--resume"]  # fmt: skip
    assert "HOSTFILE" not in out

    main([*common, "--gpus", "16", "--stages", "2"])
    out = capsys.readouterr().out
    assert launch_line(out)[:3] == ["fathom-launch", "--hostfile", "HOSTFILE"]
    assert "(HOSTFILE: DeepSpeed's hostfile of the 2 nodes, a 'HOST slots=GPUS' line each;" in out

    hostfile = tmp_path / "my hosts"
    hostfile.write_text("node-a slots=4\nnode-b slots=4\n")
    main([*common, "--hostfile", str(hostfile), "--stages", "2"])
    assert launch_line(capsys.readouterr().out)[:3] == ["fathom-launch", "--hostfile", str(hostfile)]


@pytest.mark.slow
def test_the_launch_line_run_as_printed_trains_what_was_planned(tmp_path, capsys):
    """The printed line, run by a shell from another directory (given a free --master_port), trains the planned
    split of the planned model and precision: the run's config is the plan's."""
    save_dir = tmp_path / "run"
    given = ['bf16={"enabled": true}', "model.encoder_layers=1", "model.decoder_layers=2", "train.max_steps=1",
             f"train.save_dir={save_dir}", "data.synthetic.sentences=64"]  # fmt: skip
    main(["--config", "default", "--gpus", "2", "--gpu-memory", "8GB", "--override", *given])
    out = capsys.readouterr().out
    stages, replicas = map(int, re.search(r"bf16, ZeRO stage 1, (\d+) stages x (\d+) data-parallel", out).groups())
    line = next(line for line in out.splitlines() if line.startswith("launch: "))[len("launch: ") :]
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    # a port of its own: the suite's other jobs (one holds DeepSpeed's default 29500 on purpose) run beside it
    line = line.replace("fathom-launch ", f"fathom-launch --master_port {free_port()} ", 1)
    run = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    config = json.loads((save_dir / "config.json").read_text())
    assert config["bf16"] == {"enabled": True} and config["pipeline"]["stages"] == stages
    assert (config["model"]["encoder_layers"], config["model"]["decoder_layers"]) == (1, 2)
    assert stages * replicas == 2 and (save_dir / "latest").read_text().strip() == "global_step1"


def test_a_step_time_from_layers_timed_here(capsys):
    main(["--config", str(DEFAULT), "--gpus", "2", "--gpu-memory", "8GB", "--time-layers", "--override",
          "model.encoder_layers=2", "model.decoder_layers=2"])  # fmt: skip
    out, err = capsys.readouterr()
    assert "step s" in out and "from per-layer times measured on CPU" in out
    # each layer timed is a line as it comes (a large micro-batch on a CPU takes minutes a layer)
    assert "fathom: --time-layers: timing each distinct layer on CPU " in err
    assert "fathom: --time-layers: encoder.layers.0: forward " in err


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


def refused(capsys, argv: list[str]) -> str:
    """The one line `fathom-plan-cluster ARGV` ends with, exit status 2."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("fathom: error: "), err
    return err


@pytest.mark.parametrize(
    "size, message",
    [
        ("1.2.3GB", "--gpu-memory '1.2.3GB': expected a size like 80GB"),  # each a ValueError traceback once
        ("80..GB", "--gpu-memory '80..GB': expected a size like 80GB"),
        (".", "--gpu-memory '.': expected a size like 80GB"),
        ("0GB", "--gpu-memory: '0GB' is no memory"),  # was planned: "no split holds this run in 0.00 GiB"
        ("0.0000000001GB", "--gpu-memory: '0.0000000001GB' is no memory"),  # under a byte
        ("9" * 400, "not a size any machine has"),  # float() gives inf: an OverflowError traceback
    ],
)
def test_a_gpu_memory_that_is_no_size_is_one_line(capsys, size, message):
    err = refused(capsys, ["--config", RECIPE, "--gpus", "8", "--gpu-memory", size, "--vocab-size", "40008"])
    assert message in err


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "latin-1"])
def test_a_hostfile_that_is_not_utf8_is_one_line(tmp_path, capsys, encoding):
    """UTF-16 (as a Windows editor may save it) was a UnicodeDecodeError traceback; without a byte-order mark
    it decodes as UTF-8 with a NUL beside every character."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nodes à Orsay\nnode-a slots=4\nnode-b slots=4\n", encoding=encoding)
    err = refused(capsys, ["--config", RECIPE, "--hostfile", str(hostfile), "--gpu-memory", "80GB",
                           "--vocab-size", "40008"])  # fmt: skip
    assert f"--hostfile {hostfile}: not UTF-8 text" in err and "save it as UTF-8" in err
    assert ("as in UTF-16" in err) == encoding.startswith("utf-16")


@pytest.mark.parametrize("learned", ["true", "false"])
def test_a_length_past_max_positions_is_one_line(capsys, learned):
    """Learned positions: an IndexError traceback (the table has no row for it); sinusoids: a plan for pairs a
    run refuses."""
    small = [f"model.learned_pos={learned}", "model.max_positions=64", "model.encoder_layers=2",
             "model.decoder_layers=2"]  # fmt: skip
    plan = ["--config", str(DEFAULT), "--gpus", "2", "--gpu-memory", "8GB", "--vocab-size", "100"]
    err = refused(capsys, [*plan, "--length", "65", "--override", *small])
    assert "--length 65: beyond model.max_positions 64" in err and "give --length 64 or less" in err
    # without --length: prepare_data's longest pair (257 tokens, which the run would refuse) became 64
    main([*plan, "--override", *small])
    assert "micro-batches of at most 8 x 64 tokens" in capsys.readouterr().out
    # from the data: the synthetic task's longest pair is 7 tokens
    err = refused(capsys, [*plan[:6], "--override", *small, "model.max_positions=5"])
    assert "model.max_positions: 5 is below the data's longest pair (7 tokens)" in err


def test_the_batch_check_refusing_every_split_is_said_so(capsys):
    """train_batch_size 32 = 8 x 4 micro-batches leaves no room for replicas, and 16 GPUs on at most 4 stages
    (2L-2L) need 4 or more of them: the message spoke of memory, which no GPU size would change."""
    err = refused(capsys, ["--config", str(DEFAULT), "--gpus", "16", "--gpu-memory", "80GB", "--override",
                           "model.encoder_layers=2", "model.decoder_layers=2"])  # fmt: skip
    assert (
        "the batch check refuses every split of 16 GPUs, as a launch on it would (e.g. 1 x 16: train_batch_size: "
        "32 != train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 4 x 16 data-parallel ranks" in err
    )
    assert "memory" not in err and "GiB" not in err


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 439804651110 bytes. Error "
                     "code 12 (Cannot allocate memory)"),  # what torch's CPU allocator raises
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 310.00 GiB."),
    ],
)  # fmt: skip
def test_layers_too_large_to_time_here_are_one_line(capsys, monkeypatch, error):
    """An allocation that fails while timing was a RuntimeError traceback."""

    def out_of_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr(layer_times, "time_layers", out_of_memory)
    err = refused(capsys, ["--config", str(DEFAULT), "--gpus", "2", "--gpu-memory", "8GB", "--time-layers"])
    assert "--time-layers: a micro-batch of 8 x 7 tokens does not fit in this machine's CPU memory" in err
    assert "lower --sentences or --length), or run --time-layers on one of the cluster's GPUs" in err


def test_layers_whose_activations_exceed_the_free_memory_are_refused_before_timing(capsys, monkeypatch):
    """On a CPU the kernel may kill the process (or another's) instead of failing an allocation: a shape whose
    one layer's activations for backward alone exceed the free memory is refused before any is timed."""
    monkeypatch.setattr(layer_times, "available_memory", lambda: 2**20)
    monkeypatch.setattr(layer_times, "time_layers", lambda *args: pytest.fail("timed"))
    err = refused(capsys, ["--config", str(DEFAULT), "--gpus", "2", "--gpu-memory", "8GB", "--time-layers",
                           "--sentences", "4096"])  # fmt: skip
    assert "--time-layers: a micro-batch of 4096 x 7 tokens needs at least" in err
    assert "GiB for one layer's backward, over the 0.00 GiB free in this machine's CPU memory; time a smaller" in err


def test_the_device_named_starts_no_process(monkeypatch):
    """platform.processor() runs `uname -p` once per process: the fast tier refuses it (tests/conftest.py),
    so test_a_step_time_from_layers_timed_here failed alone and passed after a test that had cached it."""
    monkeypatch.setattr(platform, "_uname_cache", None)  # as in a fresh process
    monkeypatch.setattr(layer_times.torch.cuda, "is_available", lambda: False)
    assert layer_times.device_name().startswith(f"CPU {cpu_name()}, ")


def test_the_cpu_and_its_free_memory_are_read_from_proc(tmp_path):
    """common/machine.py: the model name, else the architecture (an ARM's /proc/cpuinfo names no model);
    MemAvailable in bytes, None where there is no such file."""
    cpuinfo, meminfo = tmp_path / "cpuinfo", tmp_path / "meminfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n")
    assert cpu_name(cpuinfo) == "AMD EPYC 7B13"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n")
    assert cpu_name(cpuinfo) == platform.machine()
    meminfo.write_text("MemTotal:       24683652 kB\nMemFree:        20981844 kB\nMemAvailable:   23509624 kB\n")
    assert available_memory(meminfo) == 23509624 * 1024
    assert available_memory(tmp_path / "absent") is None
