"""Translation speed, side by side with the first search and fairseq-generate: see tools/translation_speed.py."""

from fathom.tools.translation_speed import main

if __name__ == "__main__":
    main()
