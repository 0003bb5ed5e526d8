"""Checkpoints into other checkpoints: to and from fairseq, and averaged over the last N."""
