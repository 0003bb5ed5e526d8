"""Run with the fairseq 0.12.2 environment's Python (scripts/setup_fairseq_env.sh), not ours.

Usage: fairseq_generate.py JOBS.json
JOBS.json holds a list of fairseq-generate command lines (the arguments after the command's name). Each runs
as the fairseq-generate command runs it (fairseq_cli.generate.cli_main: its parser, its main), one after the
other in this one process: a process start (fairseq and torch imported) for all of them rather than one each.
Give each a --results-path of its own: fairseq-generate writes there, as generate-SUBSET.txt, what it would
print to stdout.
"""

import json
import logging
import sys

from fairseq_cli import generate

# fairseq-generate's logging.basicConfig would send the log to the first job's results file and then to that
# closed file: log to stderr instead, as the command does without --results-path.
logging.basicConfig(
    format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO, stream=sys.stderr
)
with open(sys.argv[1], encoding="utf-8") as f:
    jobs = json.load(f)
for job in jobs:
    sys.argv = ["fairseq-generate", *job]
    generate.cli_main()
