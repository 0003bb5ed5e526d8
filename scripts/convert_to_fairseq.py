"""Export a pipeline checkpoint to fairseq: see pipeline/to_fairseq.py or --help."""

from pipeline.to_fairseq import main

if __name__ == "__main__":
    main()
