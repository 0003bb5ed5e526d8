"""Data preparation speed and memory, side by side with fairseq's pipeline: see tools/bench_prepare.py."""

from tools.bench_prepare import main

if __name__ == "__main__":
    main()
