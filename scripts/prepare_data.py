"""Raw parallel text to a binarized dataset: see corpus/prepare.py or --help."""

from fathom.corpus.prepare import main

if __name__ == "__main__":
    main()
