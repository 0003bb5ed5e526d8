"""Translate and score with sacreBLEU: see pipeline/translate.py or --help."""

from pipeline.translate import main

if __name__ == "__main__":
    main()
