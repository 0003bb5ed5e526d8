"""Export a pipeline checkpoint to fairseq: see convert/to_fairseq.py or --help."""

from fathom.convert.to_fairseq import main

if __name__ == "__main__":
    main()
