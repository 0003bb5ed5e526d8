"""One process of a training job, as a launcher starts it:

    deepspeed --num_gpus 2 --module fathom.train --config ds_configs/default.json
    deepspeed --num_gpus 2 $(which fathom-train) --config ds_configs/default.json

(scripts/train.py is the same program by its path)."""

from functools import partial

from fathom.pipeline.train import main as train
from fathom.pipeline.world.distributed import run_launched


def main(argv: list[str] | None = None) -> None:
    """Trains, then ends the process with the run's exit status (run_launched)."""
    run_launched(partial(train, argv))


if __name__ == "__main__":
    main()
