"""What --resume does with each setting of a run's config changed since the checkpoint, read from one
declaration per setting: a field of fathom's sections declares it in its metadata
(common.sections.OnResume: the model's, each scheme's options, data, train); DeepSpeed's keys, which fathom
does not declare, have theirs below. The resume checks (pipeline/checkpoint/saving.py), the data order a
checkpoint records (pipeline/checkpoint/data_position.py), the change report (pipeline/config/history.py)
and the model check of train.init_from (model/trained.py) all read these, and keep no list of their own.
"""

from __future__ import annotations

from typing import Any

from fathom.common.sections import OnResume, resume_rules
from fathom.model.model_config import ModelConfig
from fathom.model.model_section import scheme_option_rules
from fathom.pipeline.config.deepspeed_values import precision, zero_optimization_stage
from fathom.pipeline.config.run_config import DataConfig, TrainConfig

# DeepSpeed's keys apply from the first resumed step (the engine is built from the config at every launch;
# a new pipeline shape is a reshape, pipeline/checkpoint/reshape.py), but for these. A section's entry
# covers its keys that have none of their own.
DEEPSPEED = {
    # the pairs each micro-batch holds, without data.max_tokens
    "train_micro_batch_size_per_gpu": OnResume.DATA_ORDER,
    "zero_optimization.stage": OnResume.OPTIMIZER_STATE,
    "bf16.enabled": OnResume.OPTIMIZER_STATE,
    "fp16.enabled": OnResume.OPTIMIZER_STATE,
    "optimizer.type": OnResume.OPTIMIZER_STATE,
    "optimizer.params": OnResume.OPTIMIZER_STATE,
    # the hyperparameters, which train.start writes into the loaded param groups
    "optimizer.params.lr": OnResume.APPLIED,
    "optimizer.params.betas": OnResume.APPLIED,
    "optimizer.params.eps": OnResume.APPLIED,
    "optimizer.params.weight_decay": OnResume.APPLIED,
    # the pipeline section, fathom's and DeepSpeed's keys: a resume on another shape reshapes
    "pipeline.stages": OnResume.APPLIED,
    "pipeline.partition": OnResume.APPLIED,
    "pipeline.activation_checkpoint_interval": OnResume.APPLIED,
    "pipeline.use_reentrant": OnResume.APPLIED,
    "pipeline.seed_layers": OnResume.APPLIED,
    "pipeline.pipe_partitioned": OnResume.APPLIED,
    "pipeline.grad_partitioned": OnResume.APPLIED,
}
DEEPSPEED_DEFAULT = OnResume.APPLIED


def fathoms_rules() -> dict[str, OnResume]:
    """Each setting of fathom's sections by dotted key (a nested section's key covers its keys)."""
    sections = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
    declared = {key: rule for where, cls in sections.items() for key, rule in resume_rules(cls, where).items()}
    return {**declared, **scheme_option_rules()}


def deepspeed_rule(key: str) -> OnResume:
    """What --resume does with a change to DeepSpeed's dotted `key`: its entry's, or its closest section's."""
    parts = key.split(".")
    return next(
        (DEEPSPEED[prefix] for n in range(len(parts), 0, -1) if (prefix := ".".join(parts[:n])) in DEEPSPEED),
        DEEPSPEED_DEFAULT,
    )


def settings_with(rule: OnResume) -> list[str]:
    """The dotted keys declared `rule`: fathom's in their sections' order, then DeepSpeed's."""
    return [key for key, declared in {**fathoms_rules(), **DEEPSPEED}.items() if declared is rule]


def setting(config: dict[str, Any], key: str) -> Any:
    """The value of dotted `key` in a config as its file holds it (None where it is not set)."""
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def optimizer_layout(ds: dict[str, Any]) -> dict[str, Any]:
    """What decides the form of the optimizer state a checkpoint holds: the DeepSpeed keys declared
    OPTIMIZER_STATE (pipeline/config/resume_rules.py), by key, as the engine reads them (an unset ZeRO stage
    is 0, the optimizer's name is in any case, an unset precision switch is off)."""
    read = {
        "zero_optimization.stage": zero_optimization_stage(ds),
        "optimizer.type": str(ds.get("optimizer", {}).get("type", "")).lower(),
        "bf16.enabled": precision(ds) == "bf16",
        "fp16.enabled": precision(ds) == "fp16",
    }
    settings = {**flat(ds), **read}
    return {key: value for key, value in settings.items() if deepspeed_rule(key) is OnResume.OPTIMIZER_STATE}


def applied_optimizer_arguments() -> list[str]:
    """The optimizer's arguments a resume applies from its first step (pipeline/train.py writes them into
    the param groups DeepSpeed loads): those declared APPLIED."""
    prefix = "optimizer.params."
    return [key.removeprefix(prefix) for key in settings_with(OnResume.APPLIED) if key.startswith(prefix)]
