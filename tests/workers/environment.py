"""A rank that prints, as one JSON line, what it was started with: its arguments, whether Python runs
unbuffered, and its environment. For tests/test_launch.py, which compares the real launcher's ranks with
tests/helpers.py's."""

import json
import os
import sys

print(json.dumps({"argv": sys.argv[1:], "unbuffered": sys.stdout.write_through, "env": dict(os.environ)}))
