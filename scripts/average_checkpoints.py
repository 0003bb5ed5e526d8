"""Average the weights of several checkpoints of a run into a new tag: see convert/average.py or --help."""

from fathom.convert.average import main

if __name__ == "__main__":
    main()
