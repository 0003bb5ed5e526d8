"""What reseeding dropout at every layer costs (pipeline/engine/recompute.py): training steps timed with the reseed
and without it (dropout then draws from one stream a step), in alternating blocks on one engine, so that both
see the same machine.

    deepspeed --num_gpus 1 scripts/bench_masks.py --config ds_configs/branchnorm_500L.json \\
        --override pipeline.stages=1 --blocks 4 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fathom.common.cli import command_parser
from fathom.common.errors import check_number, exit_on_config_error
from fathom.corpus.batches import MicroBatches
from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.engine.recompute import DropoutMasks
from fathom.pipeline.loop import launch_position, train_step
from fathom.pipeline.train import build_engine
from fathom.pipeline.world.distributed import init_distributed, launched_world


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser(__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--override", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing")
    parser.add_argument("--blocks", type=int, default=4, help="timed blocks of each kind, alternating")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = launched_world()
    with exit_on_config_error(report=world.rank == 0):
        check_number("--warmup", args.warmup, 0)
        check_number("--blocks", args.blocks, 1)
        check_number("--steps", args.steps, 1)
        cfg, corpus = resolve_run(args.config, [*args.override, "train.save_dir=/tmp/fathom-bench-masks"], world.size)
    init_distributed()
    engine = build_engine(cfg)
    data = MicroBatches(corpus, cfg.batch_size, cfg.train.seed, data_parallel_rank=engine.grid.get_data_parallel_rank(),
                        data_parallel_size=engine.grid.get_data_parallel_world_size())  # fmt: skip
    masks = DropoutMasks(engine, cfg.train.seed, launch_position(engine))
    reseed = masks._reseed
    step = 0

    def timed(per_layer: bool, steps: int) -> list[float]:
        nonlocal step
        # Without the per-layer reseed every layer draws on from the stream seeded once a step.
        masks._reseed = reseed if per_layer else lambda layer: None
        seconds = []
        for _ in range(steps):
            masks.start(step)
            masks.generator.manual_seed(step)
            synchronize()
            tick = time.perf_counter()
            train_step(engine, data)
            synchronize()
            seconds.append(time.perf_counter() - tick)
            step += 1
        return seconds

    timed(True, args.warmup)
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(2 * args.blocks):
        per_layer = block % 2 == 0
        times[per_layer] += timed(per_layer, args.steps)
    if world.rank == 0:
        with_reseed, without = statistics.median(times[True]), statistics.median(times[False])
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        print(f"{device}: median step {with_reseed * 1e3:.1f} ms with a reseed per layer, {without * 1e3:.1f} ms "
              f"without ({with_reseed / without:.4f}x), {len(times[True])} steps each", flush=True)  # fmt: skip
