"""Launched by tests/test_pipeline.py under `deepspeed --num_gpus S` (one replica of S stages): one SGD step
per case.

For each case it saves the pipeline's weights before and after one optimizer step (through the training
loop's train_step), and the engine's loss and counted tokens, so the test can replay the step in the
single-process model; then it translates the
first validation sentences through the stages (pipeline/decode.py), for the test to compare with the
single-process search on the "after" weights.
Usage: parity.py CONFIG OUT_DIR CASE=OVERRIDE[,OVERRIDE...] ...
"""

import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from fathom.common.run_layout import CONFIG_FILE
from fathom.corpus.batches import MicroBatches
from fathom.model.norms import build_scheme
from fathom.model.schedule import ScheduleHook
from fathom.pipeline.config.run_config import ValidBleu
from fathom.pipeline.config.run_data import build_corpus, resolve_run
from fathom.pipeline.decode import translate
from fathom.pipeline.engine import admin_profile
from fathom.pipeline.engine.internals import stage_range
from fathom.pipeline.loop import train_step
from fathom.pipeline.parts.stage_modules import DecoderLayerPipe, EncoderLayerPipe
from fathom.pipeline.train import build_engine, profile_batch
from fathom.pipeline.world.distributed import init_distributed, run_launched

STEP = 2  # BranchNorm's alpha is moved to this step: 0.5 with T = 4
DECODED = 12  # validation sentences translated through the stages, in batches of 5
SEARCH = {"beam": 3, "lenpen": 0.6, "max_len_a": 0.0, "max_len_b": 8}


@contextmanager
def counting_layer_builds() -> Iterator[Counter]:
    """Counts the Transformer layers built in this process while the block runs: a rank that built
    every layer and then kept only its stage's would still be caught."""
    built: Counter = Counter()
    originals = {cls: cls.__init__ for cls in (EncoderLayerPipe, DecoderLayerPipe)}
    for cls, init in originals.items():

        def counted(self, *args, _init=init, **kwargs):
            built[type(self).__name__] += 1
            _init(self, *args, **kwargs)

        cls.__init__ = counted
    try:
        yield built
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


@contextmanager
def counting_gradient_accumulations(layers: list) -> Iterator[Counter]:
    """How often autograd accumulated a gradient into each Transformer-layer parameter of this stage."""
    counts: Counter = Counter()
    params = [(f"{i}.{name}", p) for i, layer in enumerate(layers) for name, p in layer.named_parameters()]
    handles = [p.register_post_accumulate_grad_hook(lambda _, key=key: counts.update([key])) for key, p in params]
    counts.update({key: 0 for key, _ in params})
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def main():
    init_distributed()
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
    config_path, out = args[0], Path(args[1])
    for case in args[2:]:
        name, _, overrides = case.partition("=")
        save_dir = out / name
        cfg, corpus = resolve_run(
            config_path, [f"train.save_dir={save_dir}", *overrides.split(",")], world_size=dist.get_world_size()
        )
        with counting_layer_builds() as built:
            engine = build_engine(cfg)
        if dist.get_rank() == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
            (save_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
        if build_scheme(cfg.model).profiling():
            dist.barrier()  # save_dir exists before rank 0 writes the profile into it
            admin_profile.initialize(engine, cfg.model, profile_batch(cfg, corpus), save_dir)
        ScheduleHook(engine.module)(STEP)
        engine.save_checkpoint(str(save_dir), tag="before")
        data = MicroBatches(corpus, cfg.batch_size, cfg.train.seed)
        mine = [m for m in engine.module.modules() if isinstance(m, EncoderLayerPipe | DecoderLayerPipe)]
        with counting_gradient_accumulations(mine) as accumulated:
            record = train_step(engine, data)
        engine.save_checkpoint(str(save_dir), tag="after")
        held = stage_range(engine.module)
        layers = {
            "start": held.start,
            "stop": held.stop,
            "built": sum(built.values()),
            "layer_kinds": sorted({type(layer).__name__ for layer in mine}),
            "gradient_accumulations": sorted(set(accumulated.values())),
        }
        step = {"loss": record["loss"], "tokens": record["tokens"]}
        (save_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps({**step, **layers}))
        ScheduleHook(engine.module)(engine.global_steps)  # as load_reference sets the "after" weights
        valid = build_corpus(cfg, "valid")
        sources = [valid.pair(i)[0] for i in range(DECODED)]
        found = translate(engine, cfg.model, sources, ValidBleu(batch_size=5, **SEARCH))
        if dist.get_rank() == 0:
            hypotheses = [{"tokens": h.tokens, "score": h.score} for h in found]
            (save_dir / "decoded.json").write_text(json.dumps(hypotheses))


if __name__ == "__main__":
    run_launched(main)
