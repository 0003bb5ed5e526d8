"""Prints the norm-scheme registry as a Markdown table: python scripts/list_schemes.py"""

from model.norms import registry_table

if __name__ == "__main__":
    print(registry_table())
