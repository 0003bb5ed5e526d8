"""Training throughput on this machine's CPU or one GPU: see tools/bench.py or --help."""

from fathom.pipeline.world.distributed import run_launched
from fathom.tools.bench import main

if __name__ == "__main__":
    run_launched(main)  # its gloo group, like a launched run's
