"""Translate raw text with a trained run: see pipeline/translate.py or --help."""

from pipeline.translate import main

if __name__ == "__main__":
    main()
