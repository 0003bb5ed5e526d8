"""What reseeding dropout at every layer costs: see tools/bench_masks.py."""

from tools.bench_masks import main

if __name__ == "__main__":
    main()
