"""What fathom's engine does with each top-level key the pinned DeepSpeed reads: it applies it, or the
feature does not act in fathom's engine and the key is refused before launch in one line saying what
fathom does instead. A key DeepSpeed would accept and then ignore (or use differently than its docs
say, because fathom replaces that part of the engine) would otherwise pass for a setting that acts.

A refused key is refused only where it asks for something: where DeepSpeed reads the config the engine
gets (pipeline/config/deepspeed_values.py's engine_config) otherwise with it than without it
(`"flops_profiler": {"enabled": false}` asks for nothing). Keys DeepSpeed
0.19.8 has removed it refuses itself (`nebula`, `amp`, ...). tests/test_config.py checks that every key
DeepSpeedConfig reads has its entry here, and docs/TRAINING.md's table is this module in words.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fathom.common.errors import ConfigError
from fathom.pipeline.config.deepspeed_keys import READ_BY_INITIALIZE, probe_config

# Keys DeepSpeed's engine applies in fathom's, and what they do there.
APPLIED = {
    "train_batch_size": "checked against the world size before launch",
    "train_micro_batch_size_per_gpu": "sentences per micro-batch without data.max_tokens",
    "gradient_accumulation_steps": "micro-batches a replica accumulates per step",
    "steps_per_print": "the engine's line `steps: N loss: ... iter time (s): ... samples/sec: ...` every N steps",
    "optimizer": "the optimizer; its hyperparameters apply from the first resumed step",
    "scheduler": "the learning-rate schedule",
    "zero_optimization": "ZeRO stage 0 or 1 (the pipeline engine refuses 2 and 3)",
    "bf16": "the precision",
    "fp16": "the precision (on GPUs, with ZeRO-1)",
    "gradient_clipping": "the clipping norm",
    "pipeline": "stages, activation checkpointing interval, partition (fathom's keys and DeepSpeed's)",
    "csv_monitor": "the engine's train loss and learning rate, and fathom's figures (fathom/KEY), as CSV files",
    "tensorboard": "the same events as csv_monitor, as TensorBoard files (needs the tensorboard package)",
    "wandb": "the same events as csv_monitor, to Weights & Biases (needs the wandb package)",
    "comet": "the same events as csv_monitor, to Comet (needs the comet_ml package)",
    "comms_logger": "DeepSpeed's communication ops timed; fathom prints DeepSpeed's summary when the run ends",
    "memory_breakdown": "the engine's memory before and after each micro-batch's forward and backward",
    "dump_state": "the engine's state when it starts (a DeepSpeed info line: with log_level info)",
    "log_level": "the level of DeepSpeed's own log lines",
    "checkpoint": "tag_validation, checkpoint_serialization and parallel_write; its other keys are refused",
    "data_types": "the dtypes of gradient accumulation, parameters and buffers",
    "communication_data_type": "the dtype of the gradient all-reduce across replicas (none on one replica)",
    "gradient_predivide_factor": "the gradient all-reduce across replicas (none on one replica)",
    "prescale_gradients": "the gradient all-reduce across replicas (none on one replica)",
    "gradient_allreduce_op": "the gradient all-reduce across replicas (none on one replica)",
    "zero_allow_untested_optimizer": "which optimizers ZeRO-1 accepts",
    "zero_force_ds_cpu_optimizer": "which optimizers ZeRO-1 accepts with CPU offload",
}

# Keys whose feature does not act in fathom's engine, and what fathom does instead.
REFUSED = {
    "activation_checkpointing": "fathom checkpoints every pipeline.activation_checkpoint_interval layers with its own "
    "function, which reseeds each layer's dropout instead of saving random states, so none of DeepSpeed's "
    "activation-checkpointing settings applies",
    "flops_profiler": "DeepSpeed's pipeline engine never prints its profile (and the profiler turns on "
    "wall_clock_breakdown, which that engine fails with); train.time_breakdown times each pipeline instruction, "
    "scripts/bench.py --profile counts a layer's operations",
    "wall_clock_breakdown": "DeepSpeed's pipeline engine fails with it (a timer started twice); "
    "train.time_breakdown=true times each pipeline instruction per step",
    "data_efficiency": "DeepSpeed's data sampling and routing act through its own data loader, which fathom does not "
    "use: it reads its own length-grouped micro-batches (data.max_tokens)",
    "dataloader_drop_last": "it acts on DeepSpeed's own data loader, which fathom does not use",
    "autotuning": "it acts under `deepspeed --autotuning`, which tunes DeepSpeed's own ZeRO and batch settings by "
    "launching jobs of its own; scripts/estimate_memory.py says what fits",
    "aio": "DeepSpeed's async I/O serves NVMe offload (ZeRO-3) and its fast checkpoint writer, neither of which "
    "fathom's engine runs",
    "datastates_ckpt": "it replaces the checkpoint engine, and fathom's crash-safe commit (fsync and a manifest of "
    "every file) needs DeepSpeed's torch checkpoint engine",
    "checkpoint.writer": "it replaces the checkpoint engine, and fathom's crash-safe commit (fsync and a manifest of "
    "every file) needs DeepSpeed's torch checkpoint engine",
    "checkpoint.load_universal": "fathom converts a checkpoint to DeepSpeed's universal form and loads it by itself "
    "when --resume changes the shape",
    "checkpoint.use_node_local_storage": "fathom's checkpoints are written once into train.save_dir, which every "
    "node shares, and each rank's files are named by its global rank in the manifest",
    "bfloat16": "it is DeepSpeed's old name for bf16, the section fathom reads for the run's precision (write it as "
    "bf16)",
    "torch_autocast": "fathom's precision is bf16.enabled or fp16.enabled, which its checks, warnings and resume "
    "compare",
    "compile": "it configures DeepSpeed's engine.compile(), which fathom never calls; train.compile compiles each "
    "Transformer layer",
    "disable_python_gc": "it leaves Python's garbage collection to calls from the training loop, which fathom's does "
    "not make (cyclic garbage would grow for the whole run)",
    "hybrid_engine": "DeepSpeed's hybrid (RLHF) engine is not the pipeline engine fathom trains with",
    "tensor_parallel": "fathom's parallelism is pipeline stages and data-parallel replicas; there is no tensor "
    "parallelism",
    "expert_parallel": "fathom's models have no mixture-of-experts layers",
    "use_data_before_expert_parallelism": "fathom's models have no mixture-of-experts layers",
    "weight_quantization": "it quantizes weights under ZeRO-3, which DeepSpeed's pipeline engine does not run",
    "timers": "DeepSpeed's pipeline engine starts its throughput timer and never reports it (only DeepSpeedEngine.step "
    "does, which it does not call), while the timer synchronizes the device at every micro-batch; metrics.jsonl "
    "has each step's tokens_per_s",
    "managed_gradient_accumulation": "DeepSpeed's pipeline engine accumulates the micro-batches of a step itself, "
    "and fails at launch without (true, its default, passes)",
    "disable_allgather": "DeepSpeed 0.19.8 reads it and uses it nowhere",
    "vocabulary_size": "DeepSpeed's training engine does not use it; fathom takes the vocabularies from the data",
    "seq_parallel_communication_data_type": "fathom has no sequence parallelism",
    "sequence_parallel_size": "fathom has no sequence parallelism",
    "data_parallel_size": "fathom's data-parallel replicas are the world size over pipeline.stages",
}


def check_sections(ds: dict[str, Any], engine_gets: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Refuses, in one line, a key of REFUSED that the run's DeepSpeed keys `ds` give and that asks for
    something; `engine_gets`: the config the engine gets from them, fathom's defaults added."""
    for key, instead in REFUSED.items():
        if given(ds, key) and asks_for_something(ds, key, engine_gets):
            raise ConfigError(f"{key}: {instead}; remove it")


def given(ds: dict[str, Any], key: str) -> bool:
    *sections, last = key.split(".")
    node: Any = ds
    for section in sections:
        node = node.get(section) if isinstance(node, dict) else None
    return isinstance(node, dict) and last in node


def asks_for_something(ds: dict[str, Any], key: str, engine_gets: Callable[[dict[str, Any]], dict[str, Any]]) -> bool:
    """Whether DeepSpeed reads the engine's config of `ds` otherwise than that of `ds` without `key` (a key
    deepspeed.initialize reads itself always asks for something)."""
    if key in READ_BY_INITIALIZE:
        return True
    without = copy.deepcopy(ds)
    *sections, last = key.split(".")
    node = without
    for section in sections:
        node = node[section]
    del node[last]
    return read(engine_gets(ds)) != read(engine_gets(without))


def read(ds: dict[str, Any]) -> Any:
    """What DeepSpeedConfig makes of `ds`, as comparable values."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = vars(DeepSpeedConfig(probe_config(ds)))
    return plain({key: value for key, value in parsed.items() if key != "_param_dict"})


def plain(value: Any) -> Any:
    """`value` as dicts, lists and scalars: DeepSpeed keeps some sections as objects without equality."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return plain(dict(value))
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return plain(vars(value))
    return value
