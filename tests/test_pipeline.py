"""The DeepSpeed pipeline (real launcher, 2 to 4 CPU ranks) against the single-process reference."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fathom.common.run_layout import PROFILE_FILE
from fathom.corpus.batches import MicroBatches, eval_batches, with_eos
from fathom.model import SCHEMES
from fathom.model.admin import admin_residuals, apply_omegas, omegas_from, profile
from fathom.model.loss import label_smoothed_cross_entropy
from fathom.model.model_config import PAD
from fathom.model.schedule import ScheduleHook
from fathom.model.search import SearchConfig, beam_search
from fathom.model.trained import load_reference, model_config
from fathom.pipeline.config.run_config import load_config
from fathom.pipeline.config.run_data import build_corpus, resolve_run
from fathom.pipeline.parts.stage_cuts import stage_bounds
from fathom.pipeline.parts.stage_modules import TRANSFORMER_LAYERS, pipe_parts
from fathom.pipeline.train import profile_batch
from tests.helpers import ROOT, built_once, launch
from tests.workers.parity import SEARCH

pytestmark = pytest.mark.slow

LR = 1.0
PARITY_CONFIG = {
    "train_batch_size": 6,
    "train_micro_batch_size_per_gpu": 3,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 1000000,
    "optimizer": {"type": "SGD", "params": {"lr": LR}},
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,  # DeepSpeed clips to 1.0 unless told otherwise
    "pipeline": {"stages": 2, "activation_checkpoint_interval": 1},
    "model": {
        "encoder_layers": 2,
        "decoder_layers": 3,
        "embed_dim": 32,
        "ffn_dim": 64,
        "attention_heads": 4,
        "dropout": 0.0,
        "share_all_embeddings": True,
        "branchnorm": {"T": 4},
    },
    "data": {"synthetic": {"sentences": 64}},
    "train": {"seed": 3},
}
# Every scheme with all embeddings tied across the two stages; the other two sharing modes once.
CASES = {
    **{name: f"model.norm_scheme={name}" for name in SCHEMES},  # the registry's, so a new scheme is covered
    "pre_ln_untied": "model.norm_scheme=pre_ln,model.share_all_embeddings=false",
    "branchnorm_decoder_tied": (
        "model.norm_scheme=branchnorm,model.share_all_embeddings=false,model.share_decoder_input_output_embed=true"
    ),
}


REAL_DATA_CASE = "branchnorm_multi30k_token_batches"


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory, multi30k_slice):
    cases = {**CASES, REAL_DATA_CASE: f"model.norm_scheme=branchnorm,data.path={multi30k_slice},data.max_tokens=120"}

    def train(out: Path) -> None:
        (out / "parity.json").write_text(json.dumps(PARITY_CONFIG))
        args = [f"{name}={overrides}" for name, overrides in cases.items()]
        result = launch(ROOT / "tests" / "workers" / "parity.py", str(out / "parity.json"), str(out), *args)
        assert result.returncode == 0, "the parity worker failed (its output is above)"

    out = built_once(tmp_path_factory, "parity_runs", train)
    return out / "parity.json", out, cases


def assert_step_equals_single_process(config, out, case, overrides, world_size):
    """The pipeline's one SGD step of `case` (tests/workers/parity.py), replayed in the single-process model
    from the same weights: the same loss and gradients. Returns the micro-batches of the step."""
    cfg = load_config(config, [f"train.save_dir={out / case}", *overrides.split(",")], world_size=world_size)
    model = load_reference(out / case, "before").train()
    after = load_reference(out / case, "after")
    ScheduleHook(model)(2)

    data = MicroBatches(build_corpus(cfg), cfg.batch_size, cfg.train.seed)
    accumulation = cfg.deepspeed["gradient_accumulation_steps"]
    batches = [next(data) for _ in range(accumulation)]
    losses = []
    for (src, prev), target in batches:
        loss = label_smoothed_cross_entropy(model(src, prev), target, cfg.train.label_smoothing)
        (loss / accumulation).backward()
        losses.append(loss.item())

    engine_loss = json.loads((out / case / "rank0.json").read_text())["loss"]
    assert engine_loss == pytest.approx(sum(losses) / accumulation, abs=1e-5)
    after_params = dict(after.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        # One SGD step with lr 1: the pipeline's update is minus its gradient.
        pipeline_grad = (param.detach() - after_params[name].detach()) / LR
        torch.testing.assert_close(
            pipeline_grad, param.grad, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
        checked += 1
    assert checked == len(list(model.parameters())) and checked > 0
    return batches


def assert_search_equals_single_process(config, out, case, overrides, world_size):
    """Beam search through the live stages (the worker's decoded.json) equals the single-process search on
    the weights after the step: hypotheses and scores."""
    decoded = json.loads((out / case / "decoded.json").read_text())
    cfg = load_config(config, overrides.split(","), world_size=world_size)
    valid = build_corpus(cfg, "valid")
    src = with_eos([valid.pair(i)[0] for i in range(len(decoded))])
    found = beam_search(load_reference(out / case, "after"), src, SearchConfig(**SEARCH))
    assert [h.tokens for h in found] == [d["tokens"] for d in decoded]
    assert [h.score for h in found] == pytest.approx([d["score"] for d in decoded], abs=1e-5)


@pytest.mark.parametrize("case", [*CASES, REAL_DATA_CASE])
def test_pipeline_loss_and_gradients_equal_single_process(parity_runs, case):
    config, out, cases = parity_runs
    assert_step_equals_single_process(config, out, case, cases[case], world_size=2)


@pytest.mark.parametrize("case", [*CASES, REAL_DATA_CASE])
def test_search_through_two_stages_equals_single_process(parity_runs, case):
    """Beam search run through the stages of a live pipeline (pipeline/decode.py: hidden states passed
    stage to stage, candidates broadcast from the last) gives the single-process search's hypotheses and
    scores, for every scheme and every embedding-sharing mode."""
    config, out, cases = parity_runs
    assert_search_equals_single_process(config, out, case, cases[case], world_size=2)


def test_admin_omegas_from_two_stages_equal_single_process(parity_runs):
    """The profiling pass through 2 stages sets the omegas a single-process profile of the same
    initial weights and batch sets; the run saved them beside its checkpoints."""
    config, out, cases = parity_runs
    cfg = load_config(config, [f"train.save_dir={out / 'admin'}", *cases["admin"].split(",")], world_size=2)
    pipeline = load_reference(out / "admin", "before")
    residuals = admin_residuals(pipeline)
    pipeline_omegas = {name: m.omega.detach().clone() for name, m in residuals.items()}
    apply_omegas(residuals, dict.fromkeys(residuals, 1.0))  # back to the model as built
    (src, prev), _ = profile_batch(cfg, build_corpus(cfg))
    expected = omegas_from(profile(pipeline, src, prev), cfg.model)
    assert len(expected) == 2 * 2 + 3 * 3 and len(set(expected.values())) > 2
    for name, omega in expected.items():
        torch.testing.assert_close(pipeline_omegas[name], torch.full((32,), omega), rtol=1e-6, atol=0, msg=name)
    saved = json.loads((out / "admin" / PROFILE_FILE).read_text())["omegas"]
    assert saved == pytest.approx(expected, rel=1e-6)


def test_each_rank_builds_only_its_own_stage(parity_runs):
    """The stages split the layers, and each rank constructed only its own stage's Transformer layers
    (LayerSpecs are built lazily): none built the whole model and kept a part."""
    _, out, _ = parity_runs
    ranks = [json.loads((out / "post_ln" / f"rank{r}.json").read_text()) for r in (0, 1)]
    kinds = [part.pipe_class.__name__ for part in pipe_parts(model_config(out / "post_ln"))]
    assert len(kinds) == 2 + 2 + 3 + 1  # embeddings, encoder layers, decoder layers, output projection
    assert ranks[0]["start"] == 0 and ranks[0]["stop"] == ranks[1]["start"] and ranks[1]["stop"] == len(kinds)
    assert 0 < ranks[0]["stop"] < len(kinds)
    for rank in ranks:
        own = [kind for kind in kinds[rank["start"] : rank["stop"]] if kind in TRANSFORMER_LAYERS]
        assert rank["built"] == len(own) > 0, rank


def test_each_layer_runs_backward_once_per_micro_batch(parity_runs):
    """Stage 0 holds the encoder and the first decoder layer, so it sends the decoder state and
    encoder_out on; DeepSpeed's backward, one call per tensor, ran the encoder's backward twice per
    micro-batch there (pipeline/engine/internals.backward_in_one_call). Every Transformer-layer
    parameter of both stages now accumulates exactly one gradient per micro-batch."""
    config, out, _ = parity_runs
    micro_batches = json.loads(config.read_text())["gradient_accumulation_steps"]
    for case in CASES:
        ranks = [json.loads((out / case / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["layer_kinds"] == ["DecoderLayerPipe", "EncoderLayerPipe"], ranks[0]  # the mixed stage
        for rank in ranks:
            assert rank["gradient_accumulations"] == [micro_batches], (case, rank)


# 3 and 4 stages: each case a layout whose stage boundaries (" | ") fall where a stage count past 2 puts
# them, chosen with pipeline.partition: inside the encoder, at the encoder/decoder boundary, inside the
# decoder, and around the tied embeddings (a table shared by 3 stages, or by stages 0, 1 and 3; a stage that
# starts or ends with the decoder's tied embedding; the tied output projection alone on the last stage).
# A middle stage that receives (x, src_tokens, prev_output_tokens) and sends (y, encoder_out, src_tokens)
# gets back a float gradient where it received token ids. 4 micro-batches of differing lengths make every
# middle stage receive activations after gradients within the step.
MATRIX_CONFIG = {**PARITY_CONFIG, "train_batch_size": 12, "gradient_accumulation_steps": 4}
LAYERS_2_2 = "model.encoder_layers=2,model.decoder_layers=2"
STAGE_MATRIX = {
    3: {
        # the layout (stages cut by cost): a middle stage from inside the encoder to the decoder embedding
        "pre_ln_cost": (
            "model.norm_scheme=pre_ln,model.share_all_embeddings=false,model.encoder_layers=2,model.decoder_layers=1",
            "encoder.embed_tokens encoder.layers.0 | encoder.layers.1 encoder.layer_norm decoder.embed_tokens | "
            "decoder.layers.0 decoder.layer_norm decoder.output_projection",
        ),
        "deepnorm_tied_uniform": (
            f"model.norm_scheme=deepnorm,{LAYERS_2_2},pipeline.partition=uniform",
            "encoder.embed_tokens encoder.layers.0 encoder.layers.1 | decoder.embed_tokens decoder.layers.0 | "
            "decoder.layers.1 decoder.output_projection",
        ),
        "post_ln_output_alone": (
            f"model.norm_scheme=post_ln,model.share_all_embeddings=false,model.share_decoder_input_output_embed=true,"
            f"{LAYERS_2_2},pipeline.partition=type:EncoderLayer",
            "encoder.embed_tokens encoder.layers.0 | encoder.layers.1 decoder.embed_tokens decoder.layers.0 "
            "decoder.layers.1 | decoder.output_projection",
        ),
    },
    4: {
        "sub_ln_cost": (
            f"model.norm_scheme=sub_ln,model.share_all_embeddings=false,{LAYERS_2_2}",
            "encoder.embed_tokens encoder.layers.0 | encoder.layers.1 encoder.layer_norm decoder.embed_tokens | "
            "decoder.layers.0 | decoder.layers.1 decoder.layer_norm decoder.output_projection",
        ),
        "pre_ln_tied_uniform": (
            f"model.norm_scheme=pre_ln,{LAYERS_2_2},pipeline.partition=uniform",
            "encoder.embed_tokens encoder.layers.0 encoder.layers.1 | encoder.layer_norm decoder.embed_tokens | "
            "decoder.layers.0 decoder.layers.1 | decoder.layer_norm decoder.output_projection",
        ),
        "branchnorm_tied_by_embeddings": (
            f"model.norm_scheme=branchnorm,{LAYERS_2_2},pipeline.partition=type:Embedding",
            "encoder.embed_tokens encoder.layers.0 encoder.layers.1 | decoder.embed_tokens decoder.layers.0 | "
            "decoder.layers.1 | decoder.output_projection",
        ),
    },
}
MATRIX_RUNS = [(stages, case) for stages, cases in STAGE_MATRIX.items() for case in cases]


@pytest.fixture(scope="module")
def stage_matrix(tmp_path_factory):
    """Launches every case of STAGE_MATRIX[stages] in one run, the first time a test asks for that stage count;
    returns its config and output directory."""
    launched = {}

    def run(stages):
        if stages not in launched:
            out = tmp_path_factory.mktemp(f"stages{stages}")
            config = out / "matrix.json"
            pipeline = {**MATRIX_CONFIG["pipeline"], "stages": stages}
            config.write_text(json.dumps({**MATRIX_CONFIG, "pipeline": pipeline}))
            args = [f"{name}={overrides}" for name, (overrides, _) in STAGE_MATRIX[stages].items()]
            worker = ROOT / "tests" / "workers" / "parity.py"
            launched[stages] = config, out, launch(worker, str(config), str(out), *args, processes=stages)
        config, out, result = launched[stages]
        assert result.returncode == 0, "the parity worker failed (its output is above)"
        return config, out

    return run


@pytest.mark.parametrize(("stages", "case"), MATRIX_RUNS)
def test_every_layout_of_3_and_4_stages_trains_as_one_process(stage_matrix, stages, case):
    """Each layout of STAGE_MATRIX holds the layers it names per stage, and its step over micro-batches of
    differing shapes gives the single-process model's loss and gradients; beam search through its stages
    gives the single-process search's hypotheses and scores."""
    config, out = stage_matrix(stages)
    overrides, layout = STAGE_MATRIX[stages][case]
    names = [part.name for part in pipe_parts(model_config(out / case))]
    held = [json.loads((out / case / f"rank{rank}.json").read_text()) for rank in range(stages)]
    assert " | ".join(" ".join(names[rank["start"] : rank["stop"]]) for rank in held) == layout
    batches = assert_step_equals_single_process(config, out, case, overrides, world_size=stages)
    assert len({(src.shape, prev.shape) for (src, prev), _ in batches}) > 1
    assert_search_equals_single_process(config, out, case, overrides, world_size=stages)


@pytest.mark.parametrize("stages", sorted(STAGE_MATRIX))
def test_tokens_count_each_micro_batch_once_at_3_and_4_stages(stage_matrix, stages):
    """metrics.jsonl's `tokens` (and so `tokens_per_s`) is the target tokens the step's micro-batches hold,
    counted from the data, on every rank; the middle stages load no micro-batch."""
    config, out = stage_matrix(stages)
    case = next(iter(STAGE_MATRIX[stages]))
    cfg = load_config(config, STAGE_MATRIX[stages][case][0].split(","), world_size=stages)
    data = MicroBatches(build_corpus(cfg), cfg.batch_size, cfg.train.seed)
    expected = sum(
        int(target.ne(PAD).sum()) for _, target in itertools.islice(data, MATRIX_CONFIG["gradient_accumulation_steps"])
    )
    counted = [json.loads((out / case / f"rank{rank}.json").read_text())["tokens"] for rank in range(stages)]
    assert counted == [expected] * stages


def metrics(save_dir):
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


def train(save_dir, *overrides, resume=False):
    args = ["--config", str(ROOT / "ds_configs" / "default.json"), *(["--resume"] if resume else [])]
    return launch(ROOT / "scripts" / "train.py", *args, "--override", f"train.save_dir={save_dir}", *overrides)


def test_admin_profiles_with_dropout_through_the_stages_when_asked(tmp_path):
    """model.admin.profile_dropout=true: the 2-stage profiling pass (DeepSpeed's eval_batch, which sets
    eval mode) runs with dropout, as the authors' code does, and every omega after a stack's first grows
    (both runs in one launch)."""
    admin = "model.norm_scheme=admin,model.encoder_layers=3,model.decoder_layers=3,model.dropout=0.3,train.max_steps=1"
    cases = [f"{dropout}={admin},model.admin.profile_dropout={dropout}" for dropout in ("false", "true")]
    result = launch(
        ROOT / "tests" / "workers" / "train_cases.py", str(ROOT / "ds_configs" / "default.json"), str(tmp_path), *cases
    )
    assert result.returncode == 0, "the training worker failed (its output is above)"
    omegas = {
        dropout: json.loads((tmp_path / dropout / PROFILE_FILE).read_text())["omegas"] for dropout in ("false", "true")
    }
    grown = [omegas["true"][name] / omega for name, omega in omegas["false"].items() if omega != 1.0]
    assert len(grown) == 2 * 3 - 1 + 3 * 3 - 1 and min(grown) > 1.0


def test_resume_matches_uninterrupted_run(tmp_path):
    """Default config (BranchNorm, dropout, 2 stages, ZeRO-1, checkpointing), shortened: 2+2 layers (a
    resume needs no depth), T = 8 so alpha still moves when the run is cut at step 6. The uninterrupted
    run also has DeepSpeed's sections that report (pipeline/config/deepspeed_sections.py) on, and each
    shows its output in fathom's engine."""
    common = [
        "model.encoder_layers=2",
        "model.decoder_layers=2",
        "model.branchnorm.T=8",
        "train.save_interval=3",
        "train.log_interval=1",
        "data.synthetic.sentences=500",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    monitor = json.dumps({"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "full"})
    # memory_breakdown is test_engine_settings.py's: it collects garbage at every line, 3x this run's time
    reports = ['comms_logger={"enabled": true}', "steps_per_print=1", "dump_state=true", "log_level=info"]
    uninterrupted = train(full, *common, "train.max_steps=12", f"csv_monitor={monitor}", *reports)
    assert uninterrupted.returncode == 0
    assert train(cut, *common, "train.max_steps=6").returncode == 0
    resumed = train(cut, *common, "train.max_steps=12", resume=True)
    assert resumed.returncode == 0
    assert "resumed from" in resumed.stdout and "at step 6" in resumed.stdout

    expected, got = metrics(full), metrics(cut)
    assert [r["step"] for r in got] == list(range(1, 13))
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), a["step"]
        assert b["alpha"] == a["alpha"] == min(1.0, (a["step"] - 1) / 8)
        assert b["lr"] == pytest.approx(a["lr"])
    assert sorted(p.name for p in cut.glob("global_step*")) == [
        "global_step12",
        "global_step3",
        "global_step6",
        "global_step9",
    ]
    assert expected[-1]["loss"] < expected[0]["loss"]
    assert all(r["grad_norm"] is not None and r["tokens_per_s"] > 0 for r in got)
    # DeepSpeed's own monitor, enabled from the config, logs the same losses.
    csv = (tmp_path / "csv" / "full" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert len(csv) == 1 + 12 and float(csv[-1].split(",")[1]) == pytest.approx(expected[-1]["loss"], abs=1e-4)
    # Its learning rate, by samples (32 a step), is the one after the step's scheduler step: the rate the next
    # step trains with, which metrics.jsonl logs at that next step (docs/TRAINING.md).
    rates = [line.split(",") for line in (tmp_path / "csv" / "full" / "Train_Samples_lr.csv").read_text().split()[1:]]
    assert [int(samples) for samples, _ in rates] == [32 * r["step"] for r in expected]
    assert [float(lr) for _, lr in rates[:-1]] == pytest.approx([r["lr"] for r in expected[1:]])
    assert len({r["lr"] for r in expected}) > 5  # the warmup moves it every step
    # fathom's own figures go to the same monitor, by global step, each as metrics.jsonl has it.
    for key in ("grad_norm", "tokens_per_s", "alpha", "loss", "lr"):
        rows = [line.split(",") for line in (tmp_path / "csv" / "full" / f"fathom_{key}.csv").read_text().split()[1:]]
        assert [int(step) for step, _ in rows] == [r["step"] for r in expected], key
        assert [float(value) for _, value in rows] == pytest.approx([r[key] for r in expected], rel=1e-6), key
    out = uninterrupted.stdout
    assert f"steps: 12 loss: {expected[-1]['loss']:.4f}" in out  # steps_per_print
    assert "print_configuration] DeepSpeedEngine:" in out  # dump_state, at log_level info
    summary = out[out.index("Comm. Op") :].split()  # comms_logger: DeepSpeed's table when the run ends
    assert {"send", "recv", "broadcast"} <= set(summary)


def test_every_scheme_resumes_exactly(tmp_path):
    """Every scheme through the training loop (2 stages, ZeRO-1, activation checkpointing, dropout,
    Adam), cut at step 2 and resumed, logs the uninterrupted run's losses. An Admin run given the
    first Admin run's profile skips profiling and trains identically."""
    common = (
        "model.encoder_layers=2,model.decoder_layers=2,model.embed_dim=32,model.ffn_dim=64,model.branchnorm.T=4,"
        "data.synthetic.sentences=200,train.save_interval=2,train.log_interval=1"
    )
    cases = {scheme: f"model.norm_scheme={scheme},{common}" for scheme in SCHEMES}
    profile_file = tmp_path / "admin" / "full" / PROFILE_FILE
    cases["admin_reused"] = f"model.norm_scheme=admin,model.admin.profile={profile_file},{common}"
    args = [f"{name}={overrides}" for name, overrides in cases.items()]
    result = launch(
        ROOT / "tests" / "workers" / "resume.py", str(ROOT / "ds_configs" / "default.json"), str(tmp_path), "4", *args
    )
    assert result.returncode == 0, "the resume worker failed (its output is above)"

    for case in cases:
        full, cut = metrics(tmp_path / case / "full"), metrics(tmp_path / case / "cut")
        assert [r["step"] for r in cut] == [1, 2, 3, 4], case
        assert [r["loss"] for r in cut] == pytest.approx([r["loss"] for r in full], abs=1e-6), case
    assert result.stdout.count("admin omegas profiled") == 2  # the full run and the cut run's start
    assert f"admin omegas from {profile_file}" in result.stdout
    reused = metrics(tmp_path / "admin_reused" / "full")
    assert [r["loss"] for r in reused] == [r["loss"] for r in metrics(tmp_path / "admin" / "full")]
    assert not (tmp_path / "admin_reused" / "full" / PROFILE_FILE).exists()


def test_bf16_pipeline_trains(tmp_path):
    """bf16 with 2 stages and ZeRO-1 on this CPU (3+3 layers, 20 steps: bf16 is emulated here): finite,
    falling loss; the stages are cut where the cost model says; DeepSpeed's shared-memory all-reduce
    segments do not outlive the run."""
    model = ["model.encoder_layers=3", "model.decoder_layers=3"]
    result = train(tmp_path, 'bf16={"enabled": true}', *model, "train.max_steps=20", "train.log_interval=10")
    assert result.returncode == 0
    cfg, _ = resolve_run(ROOT / "ds_configs" / "default.json", model, world_size=2)
    bounds = stage_bounds(cfg.model, 2)
    assert f"stage 0: layers 0-{bounds[1] - 1} " in result.stdout
    assert f"stage 1: layers {bounds[1]}-{bounds[2] - 1} " in result.stdout
    losses = [r["loss"] for r in metrics(tmp_path)]
    assert len(losses) == 20 and all(map(math.isfinite, losses))
    assert sum(losses[-5:]) < sum(losses[:5])
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{result.port}_*"))


def single_process_valid_loss(model, cfg, smoothing=None) -> tuple[float, float]:
    """(loss per target token, mean of the validation micro-batches' mean losses) of `model` on the run's
    validation micro-batches, label-smoothed as the run's training loss unless `smoothing` is given."""
    smoothing = cfg.train.label_smoothing if smoothing is None else smoothing
    sums, means, tokens = 0.0, [], 0
    with torch.no_grad():
        for (src, prev), target in eval_batches(build_corpus(cfg, "valid"), cfg.batch_size):
            mean = label_smoothed_cross_entropy(model(src, prev), target, smoothing).item()
            count = int(target.ne(PAD).sum())
            sums, tokens = sums + mean * count, tokens + count
            means.append(mean)
    return sums / tokens, sum(means) / len(means)


def test_train_on_real_data_then_generate(tmp_path, multi30k_slice):
    """Token batches through 2 stages, validation between training steps, best checkpoint, beam search."""
    save = tmp_path / "run"
    overrides = [
        f"data.path={multi30k_slice}", "data.max_tokens=400", "model.embed_dim=32", "model.ffn_dim=64",
        "model.encoder_layers=2", "model.decoder_layers=2", "model.share_all_embeddings=true",
        "train.max_steps=8", "train.valid_interval=4", "train.save_interval=4",
    ]  # fmt: skip
    assert train(save, *overrides).returncode == 0
    valid = [r for r in metrics(save) if "valid_loss" in r]
    assert [r["step"] for r in valid] == [4, 8] and all(math.isfinite(r["valid_loss"]) for r in valid)
    assert valid[-1]["best_valid_loss"] == min(r["valid_loss"] for r in valid)
    assert (save / "best").is_dir() and (save / "latest").read_text().strip() == "global_step8"
    # The best checkpoint, loaded into the single-process model (alpha at its step), scores the same,
    # per target token: the validation micro-batches differ in tokens, so a mean of their means differs.
    cfg = load_config(ROOT / "ds_configs" / "default.json", [f"train.save_dir={save}", *overrides], world_size=2)
    model = load_reference(save, "best")
    per_token, mean_of_means = single_process_valid_loss(model, cfg)
    assert abs(per_token - mean_of_means) > 1e-3
    best = next(r for r in valid if r["valid_loss"] == valid[-1]["best_valid_loss"])
    assert best["valid_loss"] == pytest.approx(per_token, abs=1e-5)
    assert best["valid_loss_bits"] == pytest.approx(per_token / math.log(2), abs=1e-5)
    nll, _ = single_process_valid_loss(model, cfg, smoothing=0.0)
    assert best["valid_nll_loss"] == pytest.approx(nll, abs=1e-5) and abs(nll - per_token) > 1e-3
    assert best["valid_nll_loss_bits"] == pytest.approx(nll / math.log(2), abs=1e-5)

    output = tmp_path / "hyps.txt"
    args = ["--checkpoint", str(save), "--tag", "best", "--data", str(multi30k_slice), "--subset", "test"]
    args += ["--beam", "2", "--max-len-b", "8", "--output", str(output)]
    result = subprocess.run([sys.executable, "scripts/generate.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-4].startswith("tokenized BLEU = ") and lines[-4].endswith("[moses tokenizer -a, multi-bleu, en]")
    assert lines[-3].startswith("BLEU = ") and lines[-2].startswith("chrF2 = ")
    assert lines[-1].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert len(output.read_text().splitlines()) == 50


@pytest.mark.parametrize(
    "layout", [["pipeline.stages=2"], ["pipeline.stages=1", "train_batch_size=64"]], ids=["2 stages", "2 replicas"]
)
def test_validation_bleu_keeps_the_best_checkpoint_and_equals_generate(tmp_path, multi30k_slice, layout):
    """train.valid_bleu decodes the validation set at every validation, through 2 stages or split between
    2 data-parallel replicas, logs BLEU and writes the translations; with train.best_metric=bleu the best
    checkpoint is the highest BLEU, and generate.py on it, with the same search, writes the same
    translations."""
    save = tmp_path / "run"
    search = {"beam": 2, "lenpen": 0.6, "max_len_a": 0, "max_len_b": 8}
    overrides = [
        f"data.path={multi30k_slice}", "data.max_tokens=400", "model.embed_dim=32", "model.ffn_dim=64",
        "model.encoder_layers=2", "model.decoder_layers=2", "train.max_steps=9", "train.valid_interval=3",
        f"train.valid_bleu={json.dumps({**search, 'batch_size': 16})}", "train.best_metric=bleu",
        "optimizer.params.lr=0.005", *layout,
    ]  # fmt: skip
    assert train(save, *overrides).returncode == 0
    valid = [r for r in metrics(save) if "valid_loss" in r]
    assert [r["step"] for r in valid] == [3, 6, 9]
    assert valid[-1]["best_valid_bleu"] == max(r["valid_bleu"] for r in valid)
    best_step = next(r["step"] for r in valid if r["valid_bleu"] == valid[-1]["best_valid_bleu"])
    assert (save / "best").resolve().name == f"best_global_step{best_step}"
    # the replicas' shares of the validation loss add up to the single-process model's, per target token
    cfg = load_config(ROOT / "ds_configs" / "default.json", [f"train.save_dir={save}", *overrides], world_size=2)
    per_token, _ = single_process_valid_loss(load_reference(save, "best"), cfg)
    assert next(r["valid_loss"] for r in valid if r["step"] == best_step) == pytest.approx(per_token, abs=1e-5)

    output = tmp_path / "valid.txt"
    args = ["--checkpoint", str(save), "--tag", "best", "--data", str(multi30k_slice), "--subset", "valid"]
    args += [f"--{key.replace('_', '-')}={value}" for key, value in search.items()] + ["--output", str(output)]
    result = subprocess.run([sys.executable, "scripts/generate.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert output.read_text() == (save / "translations" / f"valid-step{best_step}.txt").read_text()
    assert result.stdout.splitlines()[2].startswith(f"BLEU = {valid[-1]['best_valid_bleu']:.2f} ")
