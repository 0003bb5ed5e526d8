"""Prints the norm-scheme registry as a Markdown table (docs/SCHEMES.md's): see model/scheme_table.py."""

from fathom.model.scheme_table import main

if __name__ == "__main__":
    main()
