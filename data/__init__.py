"""The corpus fathom ships, found by name where no such file exists: `--train multi30k/train` reads
multi30k/train.de.gz from here (corpus/text.py). See multi30k/README.md for its source and terms."""
