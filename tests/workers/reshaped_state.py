"""Launched by tests/test_reshape.py with as many ranks as the shape it loads into: resumes a run's latest
checkpoint on this launch's shape (reshaping it) and saves the loaded state, untrained, into OUT_DIR.

Usage: reshaped_state.py CONFIG OUT_DIR WORLD_SIZE OVERRIDE...
"""

import sys
from pathlib import Path

from fathom.common.checkpoint_format import DATA_POSITION, SCHEDULE_OFFSET
from fathom.pipeline.checkpoint import saving
from fathom.pipeline.config.run_data import resolve_run
from fathom.pipeline.train import build_engine
from fathom.pipeline.world.distributed import init_distributed, run_launched


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # added by the launcher
    config_path, out, world_size = args[0], Path(args[1]), int(args[2])
    cfg, corpus = resolve_run(config_path, args[3:], world_size=world_size)
    init_distributed()
    engine = build_engine(cfg)
    client_state, _ = saving.load(engine, cfg.train.save_dir, cfg, corpus)
    out.mkdir(parents=True, exist_ok=True)
    # what training keeps beside DeepSpeed's
    kept = {key: client_state[key] for key in (SCHEDULE_OFFSET, DATA_POSITION)}
    saving.save(engine, out, kept, best=False, schedule_step=engine.global_steps)


run_launched(main)
