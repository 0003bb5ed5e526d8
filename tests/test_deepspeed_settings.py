"""DeepSpeed's half of the config as fathom reads it (pipeline/config/deepspeed_settings.py): every setting,
the keys a config leaves out included, is the value DeepSpeed's engine applies."""

import contextlib
import copy
import io

import pytest

from fathom.model.model_config import ModelConfig
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


@pytest.mark.slow
def test_each_setting_left_out_is_what_the_engine_applies(process_group):
    from fathom.pipeline.train import build_engine  # imports DeepSpeed's engine: only where it is built

    cfg = sparse_run()
    settings = cfg.settings
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's layer list
        engine = build_engine(cfg)
    assert settings.gradient_clipping == engine.gradient_clipping() == 1.0
    assert settings.scheduler.warmup_num_steps == engine.lr_scheduler.warmup_num_steps == 1000
    assert settings.accumulation(replicas=1) == engine.gradient_accumulation_steps() == 2
    assert settings.micro_batch_size == engine.train_micro_batch_size_per_gpu() == 2
    assert settings.checkpoint_interval == engine._config.pipeline["activation_checkpoint_interval"] == 0
    assert settings.use_reentrant is engine._config.pipeline["use_reentrant"] is False  # fathom's engine default
    assert settings.zero_stage == engine.zero_optimization_stage() == 1
    assert settings.precision == "fp32" and not engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert settings.stages == engine.num_stages == 1
