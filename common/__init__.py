"""What every package uses and none owns: the one-line error, typed config sections, whole-or-nothing files, the run
directory's layout, JSON-lines logs, CPU heap settings, a free port, where the repository is, markdown tables.
Imports no other fathom package."""
