"""What reseeding dropout at every layer costs: see tools/mask_speed.py."""

from fathom.tools.mask_speed import main

if __name__ == "__main__":
    main()
