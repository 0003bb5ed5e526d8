"""Where a resumed run reads on: the first micro-batch it has not read, whatever the later accumulation,
replica count or stage count; a change of what fills the micro-batches is refused, or starts the next
epoch when asked (pipeline/checkpoint/data_position.py). The launches: tests/test_checkpoint_safety.py."""

import numpy as np
import pytest

from fathom.common.errors import ConfigError
from fathom.common.run_layout import latest_tag
from fathom.corpus.batches import BatchSize, DataPosition, MicroBatches, epoch_batches, epoch_length
from fathom.pipeline.checkpoint.data_position import data_order, position_record, resume_position, saved_position
from fathom.pipeline.config.run_config import load_config
from fathom.pipeline.config.run_data import build_corpus
from tests.helpers import ROOT, launch, logged_steps

DEFAULT = ROOT / "ds_configs" / "default.json"
SMALL = ["data.synthetic.sentences=200", "data.synthetic.valid_sentences=0"]


def run(*overrides: str):
    cfg = load_config(DEFAULT, [*SMALL, *overrides], world_size=None)
    return cfg, build_corpus(cfg)


def saved_after(consumed: int, *overrides: str) -> dict:
    """What a checkpoint of a run with `overrides` records after reading `consumed` micro-batches."""
    cfg, corpus = run(*overrides)
    return position_record(
        consumed, epoch_length(corpus.lengths(), cfg.batch_size, cfg.train.seed), data_order(cfg, corpus)
    )


@pytest.mark.parametrize("size", [BatchSize(sentences=7), BatchSize(max_tokens=40)])
def test_every_epoch_has_as_many_micro_batches(size):
    lengths = np.random.default_rng(0).integers(1, 12, 500)
    counts = {len(epoch_batches(lengths, size, seed=3, epoch=epoch)) for epoch in range(6)}
    assert counts == {epoch_length(lengths, size, seed=3)}


def test_a_lower_accumulation_reads_on_instead_of_repeating():
    """Saved at step 4 with 4 micro-batches a step on 1 replica, resumed with 2 on 2 replicas: the resumed
    steps read micro-batches 16, 17, ... (the bug: 8-11 again, step 3's)."""
    before = DataPosition(accumulation=4, replicas=1)
    read = [before.micro_batch(step, k, 0) for step in range(4) for k in range(4)]
    assert read == list(range(16)) and before.at(4) == 16
    after = DataPosition(consumed=before.at(4), step=4, accumulation=2, replicas=2)
    resumed = sorted(after.micro_batch(step, k, replica) for step in (4, 5) for k in range(2) for replica in range(2))
    assert resumed == list(range(16, 24))


def test_micro_batches_read_on_from_a_position():
    cfg, corpus = run()
    whole = MicroBatches(corpus, cfg.batch_size, cfg.train.seed)
    expected = [next(whole)[1] for _ in range(40)]  # past the first epoch's 25
    replicas = [MicroBatches(corpus, cfg.batch_size, cfg.train.seed, 22, rank, 2) for rank in range(2)]
    got = [next(replicas[i % 2])[1] for i in range(18)]
    assert all(a.equal(b) for a, b in zip(got, expected[22:], strict=True))


def test_the_same_order_resumes_at_the_micro_batch_after_the_last_read():
    consumed, where = resume_position(saved_after(30), *run(), "global_step7")
    assert consumed == 30 and where == "data from micro-batch 30 (epoch 2: 5 of 25 read)"
    # another accumulation, micro-batch count per step or replica count is no change of order
    cfg, corpus = run("gradient_accumulation_steps=2", "train_batch_size=16")
    assert resume_position(saved_after(30), cfg, corpus, "global_step7")[0] == 30


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.max_tokens=64"], "--resume: data.max_tokens is null in global_step7 but 64 here"),
        (["train_micro_batch_size_per_gpu=4", "train_batch_size=16"],
         "--resume: train_micro_batch_size_per_gpu is 8 in global_step7 but 4 here"),
        (["train.seed=2"], "--resume: train.seed is 1 in global_step7 but 2 here"),
        (["data.synthetic.sentences=300"], "--resume: data.path holds other training pairs than global_step7"),
    ],
)  # fmt: skip
def test_a_change_of_what_fills_the_micro_batches_is_refused_or_starts_the_next_epoch(overrides, message):
    cfg, corpus = run(*overrides)
    with pytest.raises(ConfigError) as refused:
        resume_position(saved_after(30), cfg, corpus, "global_step7")
    assert str(refused.value).startswith(message), refused.value
    assert "or set train.on_data_change=next_epoch to start epoch 3 in the new order" in str(refused.value)
    cfg, corpus = run(*overrides, "train.on_data_change=next_epoch")
    consumed, where = resume_position(saved_after(30), cfg, corpus, "global_step7")
    assert consumed == 2 * epoch_length(corpus.lengths(), cfg.batch_size, cfg.train.seed)
    assert where.endswith(f"data from micro-batch {consumed}, the start of epoch 3 in the new order")


def test_a_checkpoint_at_an_epochs_end_starts_the_next_one_not_the_one_after():
    cfg, corpus = run("train.seed=2", "train.on_data_change=next_epoch")
    assert resume_position(saved_after(50), cfg, corpus, "global_step7")[0] == 2 * 25


def test_a_checkpoint_from_before_positions_were_recorded_read_accumulation_x_replicas_a_step():
    cfg, corpus = run()
    trained = {**cfg.to_dict(), "train_batch_size": 64}  # 4 micro-batches of 8 on 2 replicas
    state = {"ds_config": {k: trained[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu")}}
    saved = saved_position(state, steps=3, replicas=2, trained=trained)
    assert saved["micro_batches"] == 24 and "data.path" not in saved["order"]
    assert resume_position(saved, cfg, corpus, "global_step3")[0] == 24
    cfg, corpus = run("data.max_tokens=64", "train.on_data_change=next_epoch")
    assert resume_position(saved, cfg, corpus, "global_step3")[0] == epoch_length(
        corpus.lengths(), cfg.batch_size, cfg.train.seed
    )


def test_the_step_that_ends_an_epoch_reads_its_last_micro_batch():
    """train.max_epochs' last step: 10 micro-batches read before step 5, then 6 a step (2 on 3 replicas)."""
    position = DataPosition(consumed=10, step=5, accumulation=2, replicas=3)
    assert [position.step_ending(n) for n in (4, 10, 11, 16, 17)] == [5, 5, 6, 6, 7]


@pytest.mark.slow
def test_max_epochs_ends_the_run_with_its_epoch_and_a_resume_goes_on_to_the_next(tmp_path):
    """Epoch 1 ends in the step that reads its last micro-batch (the run saves there); a resume asked for 2
    epochs stops at the end of the second, on 2 replicas of 1 stage instead of 1 of 2."""
    cfg, corpus = run()
    per_epoch = epoch_length(corpus.lengths(), cfg.batch_size, cfg.train.seed)
    save_dir = tmp_path / "run"
    common = [*SMALL, "train.max_steps=1000", "train.log_interval=1", f"train.save_dir={save_dir}",
              "model.encoder_layers=1", "model.decoder_layers=1"]  # fmt: skip

    def train(*overrides: str) -> list[int]:
        job = launch(ROOT / "scripts" / "train.py", "--config", str(DEFAULT), "--resume", "--override", *common,
                     *overrides)  # fmt: skip
        assert job.returncode == 0
        return [step["step"] for step in logged_steps(save_dir) if "lr" in step]

    first = -(-per_epoch // 4)  # 4 micro-batches a step
    assert train("train.max_epochs=1") == list(range(1, first + 1)) and latest_tag(save_dir) == f"global_step{first}"
    second = first + -(-(2 * per_epoch - 4 * first) // 4)  # 2 replicas of 2 micro-batches: 4 a step again
    steps = train("train.max_epochs=2", "pipeline.stages=1", "gradient_accumulation_steps=2")
    assert steps == list(range(1, second + 1)) and latest_tag(save_dir) == f"global_step{second}"
