"""A run's checkpoints: saved and committed so that a crash at any moment loses nothing committed, resumed
on the same shape or another, and the run directory that one run at a time owns."""
