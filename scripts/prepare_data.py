"""Raw parallel text to a binarized dataset: see pipeline/prepare.py or --help."""

from pipeline.prepare import main

if __name__ == "__main__":
    main()
