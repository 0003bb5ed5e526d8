"""Entry point for the deepspeed launcher: deepspeed --num_gpus S scripts/train.py --config FILE."""

from pipeline.launched import run_launched
from pipeline.train import main

if __name__ == "__main__":
    run_launched(main)
