"""Entry point for the deepspeed launcher: deepspeed --num_gpus S scripts/train.py --config FILE."""

from pipeline.train import main
from pipeline.world import run_launched

if __name__ == "__main__":
    run_launched(main)
