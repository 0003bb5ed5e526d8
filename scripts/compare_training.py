"""Trains fathom's model and torchscale's side by side on the same batches; see tools/training_comparison.py.

python scripts/compare_training.py --config CONFIG [--override KEY=VALUE ...] --at STEP [STEP ...]
"""

from fathom.tools.training_comparison import main

if __name__ == "__main__":
    main()
