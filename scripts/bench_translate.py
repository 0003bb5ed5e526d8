"""Translation speed, side by side with the first search and fairseq-generate: see pipeline/bench_translate.py."""

from pipeline.bench_translate import main

if __name__ == "__main__":
    main()
