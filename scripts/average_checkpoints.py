"""Average the weights of several checkpoints of a run into a new tag: see pipeline/average.py or --help."""

from pipeline.average import main

if __name__ == "__main__":
    main()
