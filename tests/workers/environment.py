"""A rank that writes what it was started with to OUT/rankRANK.json: its arguments, whether Python runs
unbuffered, its working directory, import path and environment, and a string's hash (two interpreters
hash differently). For tests/test_launch.py, which compares the real launcher's ranks with
tests/helpers.py's.

Usage: environment.py OUT [ARG ...]
"""

import json
import os
import sys
from pathlib import Path

started = {"argv": sys.argv, "unbuffered": sys.stdout.write_through, "cwd": os.getcwd(), "path": sys.path,
           "name": __name__, "env": dict(os.environ), "hash": hash("fathom")}  # fmt: skip
out = Path(sys.argv[2 if sys.argv[1].startswith("--local_rank") else 1])
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(started))
