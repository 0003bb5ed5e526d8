"""Data preparation speed and memory, side by side with fairseq's pipeline: see tools/preparation_speed.py."""

from fathom.tools.preparation_speed import main

if __name__ == "__main__":
    main()
