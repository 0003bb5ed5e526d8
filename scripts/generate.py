"""Translate a prepared split and score it with sacreBLEU: see pipeline/generate.py or --help."""

from pipeline.generate import main

if __name__ == "__main__":
    main()
