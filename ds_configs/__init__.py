"""The configs fathom ships, found by name: --config default reads default.json from here."""
