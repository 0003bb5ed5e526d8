"""Launched by the tests under `deepspeed --num_gpus 2`: trains one run per case into OUT/CASE.

Usage: train_cases.py CONFIG OUT_DIR CASE=OVERRIDE[,OVERRIDE...] ...
"""

import sys
from pathlib import Path

from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.train import train
from fathom.pipeline.world.distributed import run_launched


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
    config_path, out = args[0], Path(args[1])
    for case in args[2:]:
        name, _, overrides = case.partition("=")
        cfg, corpus = resolve_run(config_path, [f"train.save_dir={out / name}", *overrides.split(",")], world_size=2)
        train(cfg, corpus, resume=False)


run_launched(main)
