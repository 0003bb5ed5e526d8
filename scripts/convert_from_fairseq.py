"""Import a fairseq Transformer checkpoint: see pipeline/from_fairseq.py or --help."""

from pipeline.from_fairseq import main

if __name__ == "__main__":
    main()
