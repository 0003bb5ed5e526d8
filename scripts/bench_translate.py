"""Translation speed, side by side with the first search and fairseq-generate: see tools/bench_translate.py."""

from tools.bench_translate import main

if __name__ == "__main__":
    main()
