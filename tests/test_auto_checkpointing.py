"""pipeline.activation_checkpoint_interval "auto" (pipeline/parts/auto_checkpointing.py): the least
recomputation whose estimated peak fits every stage in the memory less the reserve, chosen before launch;
train.memory_budget stands in for a GPU's memory on CPUs, and memory.json records the choice beside the
measured peaks."""

import json

import pytest

from fathom.common.errors import ConfigError
from fathom.common.run_layout import CONFIG_FILE, DEEPSPEED_CONFIG_FILE, MEMORY_FILE
from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.launch.checks import check_run, parse_train_args
from fathom.pipeline.parts import auto_checkpointing
from fathom.pipeline.parts.activation_trace import trace_layers
from fathom.pipeline.parts.auto_checkpointing import (
    KEPT_HEAP,
    MEMORY_RESERVE,
    candidates,
    choose_interval,
    launch_shape,
)
from fathom.pipeline.parts.stage_memory import FIXED_BYTES, Device
from fathom.pipeline.reports.memory import MeasuredPeak
from fathom.planner.cluster_plan import Split, plan_split
from fathom.planner.estimate import main as estimate_main
from tests.helpers import ROOT, launch

DEFAULT = ROOT / "ds_configs" / "default.json"
# Long sentences in full micro-batches: activations, not the optimizer's step, set the peak, so the
# checkpoint interval decides it (no checkpointing ~206 MiB on stage 0, every layer ~150, every 2 ~167).
SMALL = [
    "model.encoder_layers=6", "model.decoder_layers=6", "data.synthetic.min_len=30", "data.synthetic.max_len=40",
    "data.synthetic.sentences=2000", "train_micro_batch_size_per_gpu=32", "train_batch_size=128",
    "pipeline.activation_checkpoint_interval=auto",
]  # fmt: skip
WORLD = 2  # the config's 2 stages, one replica


def checked(tmp_path, *overrides: str):
    """The launch's config, as check_run gives it to every rank and to scripts/launch.py."""
    args = parse_train_args(["--config", str(DEFAULT), "--override", *SMALL, f"train.save_dir={tmp_path}", *overrides])
    return check_run(args, WORLD)


def budget(usable: int) -> str:
    """A train.memory_budget whose usable part (less the reserve) is `usable` bytes, to a byte or two."""
    return f"train.memory_budget={usable / (1 - MEMORY_RESERVE) / 2**20:.6f}MiB"


@pytest.fixture(scope="module")
def tried(tmp_path_factory):
    """Every interval's estimate for SMALL's launch, as "auto" weighs them."""
    cfg, corpus = checked(tmp_path_factory.mktemp("run"), "train.memory_budget=10GB")
    shape = launch_shape(cfg, corpus)
    return {c.interval: c for c in candidates(cfg, trace_layers(cfg, shape.length), shape, 2, 1, Device("cpu"))}


def test_a_budget_below_no_checkpointing_chooses_the_least_recomputation_that_fits(tmp_path, tried):
    usable = (tried[0].peak + tried[1].peak) // 2
    assert tried[1].peak < usable < tried[0].peak
    cfg, _ = checked(tmp_path, budget(usable))
    chosen = cfg.deepspeed["pipeline"]["activation_checkpoint_interval"]
    fitting = [c for c in tried.values() if c.peak <= usable]
    assert chosen >= 1 and tried[chosen].peak <= usable
    # every interval from 1 on recomputes each checkpointed layer once; a longer run that takes in an
    # embedding leaves its layers out: the choice recomputes least, not merely the lowest peak (interval 1)
    assert tried[chosen].recomputed == min(c.recomputed for c in fitting)
    assert tried[chosen].recomputed < tried[1].recomputed
    choice = cfg.auto_checkpointing
    assert choice.interval == chosen and choice.estimated_peaks == tried[chosen].peaks
    assert abs(choice.usable - usable) <= 2
    # the engine gets the number; the run's records keep what was asked, which a resume chooses anew
    assert cfg.to_dict()["pipeline"]["activation_checkpoint_interval"] == "auto"
    assert choice.line().startswith(f'activation checkpointing "auto": every {chosen} layers; estimated peak ')


def test_a_large_budget_chooses_no_checkpointing(tmp_path, tried):
    cfg, _ = checked(tmp_path, "train.memory_budget=1GiB")
    assert cfg.deepspeed["pipeline"]["activation_checkpoint_interval"] == 0
    assert cfg.auto_checkpointing.estimated_peaks == tried[0].peaks
    assert '"auto": none; estimated peak' in cfg.auto_checkpointing.line()


def test_on_a_cpu_the_line_says_what_a_kept_heap_adds(tmp_path):
    """train.cpu_heap=keep held 1.75x the estimate on a 12L-12L d 256 run, past its budget; return held
    what the estimate counts (16% below it)."""
    kept, _ = checked(tmp_path, "train.memory_budget=1GiB")
    returned, _ = checked(tmp_path, "train.memory_budget=1GiB", "train.cpu_heap=return")
    assert kept.auto_checkpointing.line().endswith(KEPT_HEAP)
    assert returned.auto_checkpointing.line().endswith("less a 10% reserve)")


def test_with_cuda_graphs_auto_chooses_from_one(tried):
    """The graphs need checkpointing: where no checkpointing would fit, "auto" still chooses an interval
    (check_cuda_graphs, which wants a GPU, is left out: the rule is what is tested)."""
    cfg, corpus = resolve_run(DEFAULT, [*SMALL, "train.cuda_graphs=true"], WORLD)
    shape = launch_shape(cfg, corpus)
    traces = trace_layers(cfg, shape.length)
    choice = choose_interval(cfg, traces, shape, 2, 1, Device("cpu"), 2**30, "train.memory_budget")
    assert tried[0].peak < choice.usable and choice.interval >= 1


def test_no_interval_that_fits_is_one_line_naming_the_lowest_peak_and_the_fixes(tmp_path, tried):
    with pytest.raises(ConfigError) as err:
        checked(tmp_path, "train.memory_budget=60MiB")
    message = str(err.value)
    lowest = min(c.peak for c in tried.values())
    assert "\n" not in message
    assert message.startswith('pipeline.activation_checkpoint_interval: "auto" finds no interval that fits: ')
    assert f"the lowest estimated peak is {lowest / 2**20:.1f} MiB" in message
    assert "add pipeline stages (pipeline.stages), lower train_micro_batch_size_per_gpu, or raise " in message


def test_auto_on_a_cpu_without_a_budget_is_refused(tmp_path):
    with pytest.raises(ConfigError, match='^pipeline.activation_checkpoint_interval: "auto" fits the checkpointing '
                       "to the GPU's memory, and a CPU has none of its own; set train.memory_budget"):  # fmt: skip
        checked(tmp_path)


def test_on_a_gpu_auto_fits_the_gpus_memory(tmp_path, monkeypatch, tried):
    """No GPU here: torch is told of one whose memory less the reserve lies between the GPU estimates (a GPU's
    fixed part in place of a CPU rank's) without checkpointing and with it."""
    cfg, corpus = checked(tmp_path, "pipeline.activation_checkpoint_interval=0")
    cfg.deepspeed["pipeline"]["activation_checkpoint_interval"] = "auto"
    memory = int(
        ((tried[0].peak + tried[1].peak) // 2 - FIXED_BYTES["cpu"] + FIXED_BYTES["gpu"]) / (1 - MEMORY_RESERVE)
    )
    monkeypatch.setattr(auto_checkpointing.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(auto_checkpointing, "gpu_memory", lambda: memory)
    choice = auto_checkpointing.resolve_checkpointing(cfg, corpus, WORLD).auto_checkpointing
    assert choice.memory == memory and choice.source == "the GPU's memory"
    shape = launch_shape(cfg, corpus)
    on_gpu = choose_interval(cfg, trace_layers(cfg, shape.length), shape, 2, 1, Device(), memory, "the GPU's memory")
    assert choice == on_gpu and choice.interval >= 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["pipeline.activation_checkpoint_interval=1", "train.memory_budget=8GB"],
         "train.memory_budget: '8GB' is the memory pipeline.activation_checkpoint_interval \"auto\" fits, and the "
         'interval is 1; set it to "auto", or remove train.memory_budget'),
        (["pipeline.activation_checkpoint_interval=automatic"],
         'pipeline.activation_checkpoint_interval: expected an integer >= 0 (0: no checkpointing) or "auto"'),
        (["train.memory_budget=lots"], "train.memory_budget 'lots': expected a size like 80GB or 40GiB"),
        (["train.memory_budget=0GB"], "train.memory_budget: '0GB' is no memory"),
        (["pipeline.use_reentrant=true"], "pipeline.use_reentrant: reentrant activation checkpointing fails"),
        (["pipeline.partition=uniform", "train.memory_budget=8GB"],
         'pipeline.activation_checkpoint_interval: "auto" estimates stages as fathom cuts them'),
    ],
)  # fmt: skip
def test_mistakes_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        checked(tmp_path, *overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


def test_memory_records_old_and_new_are_read(tmp_path, capsys):
    """memory.json stays a list of ranks; "auto" adds its interval, the stage's estimate and the usable memory
    to each, which --measured reads as it reads records written before them."""
    old = {"rank": 0, "stage": 0, "baseline": 100, "peak": 300}
    new = {**old, "rank": 1, "stage": 1, "checkpoint_interval": 2, "estimated_peak": 190, "usable_memory": 400}
    assert MeasuredPeak(**old).checkpoint_interval is None and MeasuredPeak(**new).estimated_peak == 190
    (tmp_path / MEMORY_FILE).write_text(json.dumps([old, new]))
    estimate_main(["--config", str(DEFAULT), "--measured", str(tmp_path)])
    out = capsys.readouterr().out
    assert "rank 0 (stage 0): measured" in out and "rank 1 (stage 1): measured" in out


def test_the_planner_chooses_as_a_launch_would(tmp_path, capsys, tried):
    """estimate_memory.py with an "auto" config: train.memory_budget, else --gpu-memory; without either, one line."""
    usable = (tried[0].peak + tried[1].peak) // 2
    cfg, _ = checked(tmp_path, budget(usable))
    flags = ["--config", str(DEFAULT), "--device", "cpu", "--data-parallel", "1", "--override", *SMALL]
    estimate_main([*flags, budget(usable)])
    out = capsys.readouterr().out
    assert cfg.auto_checkpointing.line() + "\n" in out
    assert f"activation checkpoint interval {cfg.auto_checkpointing.interval}\n" in out
    with pytest.raises(SystemExit) as exc:
        estimate_main(flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert 'pipeline.activation_checkpoint_interval: "auto" fits a memory; give --gpu-memory, or set' in err


def test_the_cluster_plan_shows_autos_choice_per_split(tmp_path, tried):
    cfg, corpus = checked(tmp_path, "train.memory_budget=1GiB")
    cfg.deepspeed["pipeline"]["activation_checkpoint_interval"] = "auto"
    cfg.train.memory_budget = None
    shape = launch_shape(cfg, corpus)
    traces = trace_layers(cfg, shape.length)
    memory = int(
        ((tried[0].peak + tried[1].peak) // 2 - FIXED_BYTES["cpu"] + FIXED_BYTES["gpu"]) / (1 - MEMORY_RESERVE)
    )  # a GPU's
    plan = plan_split(cfg, traces, shape, Split(2, 1, "auto"), memory=memory)
    expected = choose_interval(cfg, traces, shape, 2, 1, Device(), memory, "--gpu-memory").interval
    assert expected >= 1 and plan.cfg.deepspeed["pipeline"]["activation_checkpoint_interval"] == expected
    assert isinstance(plan_split(cfg, traces, shape, Split(2, 1, "auto"), memory=2**20), str)


@pytest.mark.slow
def test_a_launch_prints_its_choice_and_records_it_beside_the_measured_peaks(tmp_path, tried):
    usable = (tried[0].peak + tried[1].peak) // 2
    overrides = [*SMALL, budget(usable), "train.max_steps=2", "train.save_interval=1000", f"train.save_dir={tmp_path}",
                 "train.cpu_heap=return"]  # fmt: skip
    cfg, _ = checked(tmp_path, budget(usable), "train.cpu_heap=return")
    choice = cfg.auto_checkpointing
    result = launch("scripts/train.py", "--config", str(DEFAULT), "--override", *overrides)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count(f"fathom: {choice.line()}\n") == 1, result.stdout[-2000:]
    records = json.loads((tmp_path / MEMORY_FILE).read_text())
    assert sorted(r["stage"] for r in records) == [0, 1]
    for record in records:
        assert record["checkpoint_interval"] == choice.interval >= 1
        assert record["estimated_peak"] == choice.estimated_peaks[record["stage"]]
        assert record["usable_memory"] == choice.usable
        assert record["peak"] > record["baseline"] > 0
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["pipeline"]["activation_checkpoint_interval"] == "auto"
    engine = json.loads((tmp_path / DEEPSPEED_CONFIG_FILE).read_text())
    assert engine["pipeline"]["activation_checkpoint_interval"] == choice.interval
