"""Launched by tests/test_pipeline.py under `deepspeed --num_gpus 2`: the real training loop per case,
run whole (OUT/CASE/full) and cut then resumed (OUT/CASE/cut), both logging metrics.jsonl.

Usage: resume.py CONFIG OUT_DIR STEPS CASE=OVERRIDE[,OVERRIDE...] ...
"""

import sys
from pathlib import Path

from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.train import train
from fathom.pipeline.world.distributed import run_launched


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
    config_path, out, steps = args[0], Path(args[1]), int(args[2])
    for case in args[3:]:
        name, _, overrides = case.partition("=")
        for run, max_steps, resume in (("full", steps, False), ("cut", steps // 2, False), ("cut", steps, True)):
            cfg, corpus = resolve_run(
                config_path,
                [f"train.save_dir={out / name / run}", f"train.max_steps={max_steps}", *overrides.split(",")],
                world_size=2,
            )
            train(cfg, corpus, resume)


run_launched(main)
