"""What reseeding dropout at every layer costs: see tools/mask_speed.py."""

from fathom.pipeline.world.distributed import run_launched
from fathom.tools.mask_speed import main

if __name__ == "__main__":
    run_launched(main)  # its process group, like a launched run's
