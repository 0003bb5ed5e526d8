"""One JSON file per experiment: DeepSpeed's own keys at top level plus our `model`, `data`, `train`.

Everything is checked here, before any process trains: DeepSpeed ignores keys it does not know, so a
typo anywhere would otherwise silently train the wrong model (pipeline/config/deepspeed_keys.py checks
DeepSpeed's sections against what the pinned DeepSpeed reads, pipeline/config/deepspeed_values.py their values).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from fathom.common.errors import ConfigError
from fathom.common.run_layout import META_FILE
from fathom.common.sections import APPLIED, DATA_ORDER, LOCATION, START_ONLY, bounds, parse_section
from fathom.corpus.batches import BatchSize, SyntheticConfig
from fathom.model.model_config import ModelConfig
from fathom.model.model_section import model_section, parse_model
from fathom.model.search import SearchConfig
from fathom.pipeline.config.checkpoint_choice import CheckpointChoice
from fathom.pipeline.config.config_file import apply_overrides, check_finite, config_file, read_json
from fathom.pipeline.config.deepspeed_settings import DeepSpeedSettings, deepspeed_settings
from fathom.pipeline.config.deepspeed_values import (
    AUTO_INTERVAL,
    CHECKPOINT_INTERVAL,
    DEFAULT_PARTITION,
    OUR_SECTIONS,
    check_deepspeed,
    check_schedule,
)


def check_no_tilde(path: str | None, key: str) -> None:
    """Only a shell expands ~: in a config it would make a directory named ~ where the job runs."""
    if path is not None and path.startswith("~"):
        raise ConfigError(f"{key}: {path!r} starts with ~, which a config does not expand; write the full path")


class DataNotPreparedError(ConfigError):
    """data.path names no prepared directory (yet): the memory and cluster planners can go without it."""


@dataclass
class DataConfig:
    """The training data. Each field declares what --resume does with a change to it (OnResume)."""

    # A directory written by scripts/prepare_data.py, or a list of them: shards of one corpus, prepared
    # with one vocabulary (prepare_data --vocab-from the first), trained on as one corpus (ShardedCorpus);
    # validation and test come from the first. None trains on the built-in synthetic task.
    path: str | list[str] | None = field(default=None, metadata=DATA_ORDER)
    # Token budget per micro-batch (pairs grouped by length); None: train_micro_batch_size_per_gpu pairs.
    max_tokens: int | None = field(default=None, metadata=DATA_ORDER | bounds(1))
    # Each side of a micro-batch padded to a multiple of this many tokens (fairseq's
    # --required-seq-len-multiple): fewer shapes for train.cuda_graphs to record, at the cost of pad tokens.
    pad_to_multiple: int = field(default=1, metadata=APPLIED | bounds(1, what=" (1: no padding)"))
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig, metadata=DATA_ORDER)

    def __post_init__(self) -> None:
        if self.path == []:
            raise ConfigError("data.path: an empty list; give a prepared data directory, or a list of shards")
        if isinstance(self.path, list) and len(set(self.path)) < len(self.path):
            raise ConfigError(f"data.path: {self.path} names a shard twice; give each once")
        for path in self.shards:
            check_no_tilde(path, "data.path")

    def check_prepared(self) -> None:
        """Each shard is a prepared data directory: asked where the data is read, not when the config is,
        so a plan (or anything else that reads no data) needs none."""
        for path in self.shards:
            if not (Path(path) / META_FILE).exists():
                raise DataNotPreparedError(
                    f"data.path: {path} is not a prepared data directory; run scripts/prepare_data.py"
                )

    @property
    def shards(self) -> list[str]:
        """The prepared directories training reads, in order ([] for the synthetic task)."""
        return [] if self.path is None else [self.path] if isinstance(self.path, str) else list(self.path)

    @property
    def directory(self) -> str | None:
        """The prepared directory with the dictionaries, validation and test: the first shard."""
        return self.shards[0] if self.shards else None


@dataclass
class ValidBleu(SearchConfig):
    """BLEU on the validation set at every validation (fairseq's --eval-bleu), decoded through the
    pipeline's stages with the incremental beam search (pipeline/decode.py)."""

    sentences: int = field(default=0, metadata=bounds(0, what=" (0: all of them)"))  # the first N validation sentences


@dataclass
class TrainConfig:
    """How the run trains. Each field declares what --resume does with a change to it (OnResume)."""

    max_steps: int = field(default=1000, metadata=APPLIED | bounds(1))
    # Also stop after this many passes over the training data (fairseq's --max-epoch), if that comes
    # first: after the step that reads the epoch's last micro-batch (null: train.max_steps alone).
    max_epochs: int | None = field(default=None, metadata=APPLIED | bounds(1))
    save_dir: str = field(default="checkpoints/run", metadata=LOCATION)
    save_interval: int = field(default=500, metadata=APPLIED | bounds(1))
    # It also seeds the dropout masks; torch and numpy take it (numpy's seeds are below 2^32, a rank's 2^31).
    seed: int = field(default=1, metadata=DATA_ORDER | bounds(0, below=2**31))
    log_interval: int = field(default=10, metadata=APPLIED | bounds(1))
    # Validation loss every this many steps (0: never); the best checkpoint is kept under tag "best".
    valid_interval: int = field(default=0, metadata=APPLIED | bounds(0, what=" (0: never)"))
    # BLEU on the validation set at every validation, e.g. {"beam": 4, "lenpen": 0.6} (null: off).
    valid_bleu: ValidBleu | None = field(default=None, metadata=APPLIED)
    # What "best" means: the lowest validation loss, or the highest validation BLEU.
    best_metric: Literal["loss", "bleu"] = field(default="loss", metadata=APPLIED)
    label_smoothing: float = field(default=0.1, metadata=APPLIED | bounds(0, below=1))
    # Start from these weights (a run's save_dir, or scripts/convert_from_fairseq.py's output; its
    # latest checkpoint) instead of a fresh initialization; the model section must describe the same model.
    init_from: str | None = field(default=None, metadata=START_ONLY)
    # The schedule step (BranchNorm's t) train.init_from's weights start at; null: the step they were
    # saved at (0 for weights converted from fairseq), so alpha_t goes on from where it was rather than
    # cutting every branch of trained weights at t = 0.
    init_step: int | None = field(default=None, metadata=START_ONLY | bounds(0))
    # Seconds a rank may go without progress (a step, a validation pass, a checkpoint save or load)
    # before the job ends naming the rank to blame (pipeline/safety/watchdog.py). Half an hour, torch's default
    # for gloo: far above any step, validation pass or checkpoint save we expect of a 1000-layer model on
    # a shared filesystem, and all a hung job then wastes. The backend waits 30 s longer.
    # Heartbeats come every hang_timeout / 10 s: shorter timeouts would mistake a busy machine's scheduling
    # delays or filesystem lag for a stopped rank.
    hang_timeout: float = field(default=1800.0, metadata=APPLIED | bounds(10, what=" seconds"))
    # Seconds every rank has from its launch to joining the job (imports, the data's checksums, DeepSpeed's
    # CPU op build) before the job ends naming the ranks that never joined: a node that could not start its
    # rank must not hold the others for hang_timeout.
    startup_timeout: float = field(default=600.0, metadata=APPLIED | bounds(10, what=" seconds"))
    # Besides SIGINT, SIGTERM and SIGHUP, the signal that asks for a save and a stop: the warning a
    # scheduler sends ahead of a time limit (Slurm: sbatch --signal=USR1@120; pipeline/safety/signals.py).
    exit_signal: Literal["SIGUSR1", "SIGUSR2"] = field(default="SIGUSR1", metadata=APPLIED)
    # Save and stop (exit status 75, resumable) after this many minutes of this launch, before a scheduler's
    # time limit kills it (Megatron-LM's --exit-duration-in-mins; null: no limit).
    exit_after_minutes: float | None = field(default=None, metadata=APPLIED | bounds(0.1, what=" minutes"))
    # A step whose loss or gradients are non-finite is never applied; "stop" then ends the run (exit
    # status 3; the last checkpoint stays the latest), "skip" goes on with the next step
    # (pipeline/safety/divergence.py).
    on_nonfinite: Literal["stop", "skip"] = field(default="stop", metadata=APPLIED)
    # A resume goes on with the first micro-batch the run has not read, whatever its accumulation or shape.
    # Changing what puts pairs into micro-batches (the training data, data.max_tokens, the micro-batch size
    # without it, train.seed) leaves no such micro-batch: "refuse" such a resume (one line, before launch),
    # or "next_epoch": start the new order at the start of the epoch after the one the checkpoint was in
    # (pipeline/checkpoint/data_position.py).
    on_data_change: Literal["refuse", "next_epoch"] = field(default="refuse", metadata=APPLIED)
    # Per-layer gradient norms to SAVE_DIR/grad_norms.jsonl every this many steps (0: never).
    grad_norm_interval: int = field(default=0, metadata=APPLIED | bounds(0, what=" (0: never)"))
    # Each Transformer layer's forward compiled with torch.compile (inductor; model.layers.compile_layers).
    # Off by default: on the CPUs measured it was slower than eager (docs/BENCHMARKS.md).
    compile: bool = field(default=False, metadata=APPLIED)
    # Each Transformer layer replayed from CUDA graphs in training, a graph per input shape
    # (pipeline/engine/cuda_graphs.py): one launch per layer instead of a hundred-odd. CUDA only; needs activation
    # checkpointing (pipeline.activation_checkpoint_interval >= 1).
    cuda_graphs: bool = field(default=False, metadata=APPLIED)
    # Each pipeline instruction's time (forward, backward, sends and receives, ...) per step and rank to
    # SAVE_DIR/time_breakdown.jsonl, and a line per rank at the end (pipeline/reports/time_breakdown.py).
    time_breakdown: bool = field(default=False, metadata=APPLIED)
    # On CPUs, what glibc does with freed tensors (common/heap.py): "keep" them in its heap for the next
    # step (faster), or "return" them to the system (a lower peak, the one the memory planner predicts);
    # measured in docs/BENCHMARKS.md, "The CPU heap".
    cpu_heap: Literal["keep", "return"] = field(default="keep", metadata=APPLIED)
    # The memory pipeline.activation_checkpoint_interval "auto" fits each rank in, e.g. "24GB" or "20GiB"
    # (a bare number is GB), counted above what a process holds before it builds the model; null: the
    # GPU's memory. A CPU has none of its own to go by, so there "auto" needs it (pipeline/parts/auto_checkpointing.py).
    memory_budget: str | None = field(default=None, metadata=APPLIED)

    def __post_init__(self) -> None:
        if not self.save_dir.strip():
            raise ConfigError("train.save_dir: empty; name the directory for checkpoints, e.g. checkpoints/run")
        check_no_tilde(self.save_dir, "train.save_dir")
        check_no_tilde(self.init_from, "train.init_from")
        if self.best_metric == "bleu" and self.valid_bleu is None:
            raise ConfigError('train.best_metric: bleu needs train.valid_bleu; set it, e.g. {"beam": 4}')
        if self.valid_bleu is not None and self.valid_interval == 0:
            raise ConfigError("train.valid_bleu: BLEU is computed at validations; set train.valid_interval")
        if self.init_step is not None and self.init_from is None:
            raise ConfigError(
                f"train.init_step: {self.init_step}; it is the step train.init_from's weights start at: set "
                "train.init_from"
            )


@dataclass
class RunConfig:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    deepspeed: dict[str, Any]  # the top-level DeepSpeed keys, handed to deepspeed.initialize as is
    # What "auto" checkpointing chose before launch, whose interval `deepspeed` then holds for the engine
    # (pipeline/parts/auto_checkpointing.py); the run's records keep "auto", which each launch chooses anew.
    auto_checkpointing: CheckpointChoice | None = None

    @property
    def settings(self) -> DeepSpeedSettings:
        """`deepspeed` as the engine applies it, typed (pipeline/config/deepspeed_settings.py)."""
        return deepspeed_settings(self.deepspeed)

    @property
    def stages(self) -> int:
        return self.deepspeed["pipeline"]["stages"]

    @property
    def partition(self) -> str:
        return self.deepspeed["pipeline"].get("partition", DEFAULT_PARTITION)

    def with_pipeline(self, **values: Any) -> RunConfig:
        """This config with `values` in DeepSpeed's pipeline section: a planned split, "auto"'s interval."""
        return replace(self, deepspeed={**self.deepspeed, "pipeline": {**self.deepspeed["pipeline"], **values}})

    @property
    def batch_size(self) -> BatchSize:
        if self.data.max_tokens is not None:
            return BatchSize(max_tokens=self.data.max_tokens, pad_to_multiple=self.data.pad_to_multiple)
        return BatchSize(
            sentences=self.deepspeed["train_micro_batch_size_per_gpu"], pad_to_multiple=self.data.pad_to_multiple
        )

    def to_dict(self) -> dict[str, Any]:
        deepspeed = self.deepspeed
        if self.auto_checkpointing is not None:
            deepspeed = {**deepspeed, "pipeline": {**deepspeed["pipeline"], CHECKPOINT_INTERVAL: AUTO_INTERVAL}}
        return {
            **deepspeed,
            "model": model_section(self.model),
            "data": asdict(self.data),
            "train": asdict(self.train),
        }


def load_config(path: str | Path, overrides: list[str] = (), world_size: int | None = 1) -> RunConfig:
    path = config_file(path)
    raw = read_json(path)
    apply_overrides(raw, list(overrides))
    check_finite(raw)
    ds = {k: v for k, v in raw.items() if k not in OUR_SECTIONS}
    for section in OUR_SECTIONS:
        if section not in raw:
            raise ConfigError(f'{section}: missing section; add "{section}": {{...}} to {path}')
    model = parse_model(raw["model"])
    data = parse_section(DataConfig, raw["data"], "data")
    train = parse_section(TrainConfig, raw["train"], "train")
    check_deepspeed(ds, model, world_size)
    check_schedule(ds, train.max_steps)
    return RunConfig(model=model, data=data, train=train, deepspeed=ds)
