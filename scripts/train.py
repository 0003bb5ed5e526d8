"""Entry point for the deepspeed launcher: deepspeed --num_gpus S scripts/train.py --config FILE."""

from fathom.train import main

if __name__ == "__main__":
    main()
