"""Translate a prepared split and score it with sacreBLEU: see translation/generate.py or --help."""

from fathom.translation.generate import main

if __name__ == "__main__":
    main()
