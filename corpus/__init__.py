"""Parallel text: preparing a corpus (SentencePiece, dictionaries, binarized splits) and batching it."""
