"""What a resume on another shape costs at depth: see tools/reshape_cost.py."""

from fathom.tools.reshape_cost import main

if __name__ == "__main__":
    main()
