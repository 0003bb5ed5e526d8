"""Per-stage memory of a run before launching it: python scripts/estimate_memory.py --config FILE."""

from fathom.planner.estimate import main

if __name__ == "__main__":
    main()
