"""DeepSpeed's half of the config as fathom reads it (pipeline/config/deepspeed_settings.py): every setting,
the keys a config leaves out included, is the value DeepSpeed's engine applies."""

import contextlib
import copy
import dataclasses
import io

import pytest

from fathom.model.model_config import ModelConfig
from fathom.pipeline.config.deepspeed_settings import DeepSpeedSettings
from fathom.pipeline.config.run_config import DataConfig, RunConfig, TrainConfig
from fathom.study.grid import AXIS, warmup_steps

# a config without gradient_clipping, gradient_accumulation_steps, the warmup's length, the checkpoint
# interval and use_reentrant: each is what DeepSpeed (or fathom's engine defaults) fill in
SPARSE = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}},
    "zero_optimization": {"stage": 1}, "pipeline": {"stages": 1},
}  # fmt: skip


def sparse_run() -> RunConfig:
    model = ModelConfig(encoder_layers=1, decoder_layers=1, embed_dim=16, ffn_dim=32, attention_heads=2,
                        src_vocab_size=20, tgt_vocab_size=20)  # fmt: skip
    return RunConfig(model=model, data=DataConfig(), train=TrainConfig(), deepspeed=copy.deepcopy(SPARSE))


def test_the_study_reads_a_base_without_clipping_or_warmup_as_deepspeed_trains_it():
    """gradient_clipping defaulted to 0.0 ("no clipping") in the study's grid, where DeepSpeed 0.19.8 clips at
    1.0: the grid drops an axis value equal to the base's, so a `clips: [0, ...]` cell ran clipped at 1.0. Its
    warmup defaulted to 0 where WarmupLR's is 1000 steps."""
    cfg = sparse_run()
    assert AXIS["clips"].read(cfg) == 1.0 and AXIS["clips"].sets(0.0, cfg) == ["gradient_clipping=0.0"]
    assert warmup_steps(cfg) == 1000
    assert AXIS["accumulations"].read(cfg) == 2  # from train_batch_size: there is no gradient_accumulation_steps


def precision(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


# Each field of DeepSpeedSettings: (what fathom reads, what a built engine applies). A field without an entry
# fails the test, so a new setting comes with the engine's value it is held to.
ENGINE_VALUES = {
    "micro_batch_size": (lambda s: s.micro_batch_size, lambda e: e.train_micro_batch_size_per_gpu()),
    "batch": (lambda s: s.accumulation(replicas=1), lambda e: e.gradient_accumulation_steps()),
    "gradient_clipping": (lambda s: s.gradient_clipping, lambda e: e.gradient_clipping()),
    "precision": (lambda s: s.precision, precision),
    "zero_stage": (lambda s: s.zero_stage, lambda e: e.zero_optimization_stage()),
    "stages": (lambda s: s.stages, lambda e: e.num_stages),
    "checkpoint_interval": (
        lambda s: s.checkpoint_interval,
        lambda e: e._config.pipeline["activation_checkpoint_interval"],
    ),  # fmt: skip
    "use_reentrant": (lambda s: s.use_reentrant, lambda e: e._config.pipeline["use_reentrant"]),
    "optimizer": (
        lambda s: (s.optimizer.type.lower(), s.optimizer.params),
        lambda e: (e._config.optimizer_name, e._config.optimizer_params),
    ),  # fmt: skip
    "scheduler": (lambda s: s.scheduler.warmup_num_steps, lambda e: e.lr_scheduler.warmup_num_steps),
    "comms_logger": (lambda s: s.comms_logger, lambda e: e._config.comms_config.comms_logger_enabled),
}


@pytest.mark.slow
def test_each_setting_left_out_is_what_the_engine_applies(process_group):
    from fathom.pipeline.train import build_engine  # imports DeepSpeed's engine: only where it is built

    assert set(ENGINE_VALUES) == {f.name for f in dataclasses.fields(DeepSpeedSettings)}
    cfg = sparse_run()
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's layer list
        engine = build_engine(cfg)
    applied = {name: (ours(cfg.settings), engines(engine)) for name, (ours, engines) in ENGINE_VALUES.items()}
    assert all(ours == engines for ours, engines in applied.values()), applied
    # the defaults that differed before: DeepSpeed's, and fathom's own engine default for use_reentrant
    assert applied["gradient_clipping"][0] == 1.0 and applied["scheduler"][0] == 1000
    assert applied["batch"][0] == 2 and applied["use_reentrant"][0] is False
