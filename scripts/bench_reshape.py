"""What a resume on another shape costs at depth: see tools/bench_reshape.py."""

from tools.bench_reshape import main

if __name__ == "__main__":
    main()
