"""Translate raw text with a trained run: see translation/translate.py or --help."""

from fathom.translation.translate import main

if __name__ == "__main__":
    main()
