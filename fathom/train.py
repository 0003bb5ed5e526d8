"""One process of a training job, as a launcher starts it:

    deepspeed --num_gpus 2 --module fathom.train --config ds_configs/default.json
    deepspeed --num_gpus 2 $(which fathom-train) --config ds_configs/default.json

(scripts/train.py is the same program by its path)."""

from fathom.pipeline.launched import run_launched
from fathom.pipeline.train import main as train


def main() -> None:
    run_launched(train)


if __name__ == "__main__":
    main()
