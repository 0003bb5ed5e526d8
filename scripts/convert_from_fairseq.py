"""Import a fairseq Transformer checkpoint: see convert/from_fairseq.py or --help."""

from fathom.convert.from_fairseq import main

if __name__ == "__main__":
    main()
