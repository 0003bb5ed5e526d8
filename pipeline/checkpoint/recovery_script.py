"""fathom's zero_to_fp32.py and zero_to_torch.py, which its saves write into every train.save_dir where
DeepSpeed would copy its own: those read the weights from mp_rank_00_model_states.pt, which a pipeline
checkpoint keeps in its layer files instead, and fail. This one takes DeepSpeed's arguments and writes what
they promise, OUTPUT_DIR/pytorch_model.bin, the whole model as one state dict under fairseq's names
(pipeline/checkpoint/consolidated.py):

    python zero_to_fp32.py SAVE_DIR OUTPUT_DIR [--tag TAG]
    python zero_to_torch.py SAVE_DIR OUTPUT_DIR --dtype fp32|fp16|bf16 [--tag TAG]
"""

import sys
from pathlib import Path

try:
    from fathom.pipeline.checkpoint.consolidated import main
except ModuleNotFoundError as err:
    if not err.name.startswith("fathom"):
        raise
    # Run with a Python without fathom: one line saying what to run instead of a traceback.
    print(
        "fathom: error: this checkpoint was written by fathom, whose code reads it: run this script with the "
        "Python fathom is installed in (pip install -e FATHOM), or python FATHOM/scripts/zero_to_fp32.py "
        "SAVE_DIR OUTPUT_DIR from a fathom checkout",
        file=sys.stderr,
    )
    sys.exit(2)

if __name__ == "__main__":
    main(sys.argv[1:], dtype_required=Path(__file__).name == "zero_to_torch.py")
