"""glibc's heap settings for a CPU process: freed blocks kept for reuse, or handed back to the system.

A training step and a beam-search position both free and allocate the same large blocks again and
again. Handed back and mapped afresh each time, every page of them faults in anew: beam search ran
1.5-1.8x slower (the Multi30k model inside a training run), and a training step of 6L-6L d 512
1.2x slower in fp32 and 1.5x in bf16 (docs/BENCHMARKS.md), ZeRO-1's flat buffers included. Kept in
the heap, they cost a higher peak instead (1.1-1.5x the resident memory). Training chooses with
`train.cpu_heap`; decoding always keeps them. GPU memory is CUDA's and unaffected.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
RETURNED_BLOCKS = 128 * 1024  # bytes: "return" hands freed blocks larger than this back to the system
# "keep" (and decoding): freed blocks up to this size stay in the heap, and so does free memory at the
# heap's top up to this much: mallopt's largest value, so ZeRO's flat gradient and fp32 buffers (190 MB
# at 6L-6L d 512) are reused rather than mapped afresh every step
KEPT_BLOCKS = KEPT_TRIM = 2**31 - 1


def _set(mmap_threshold: int, trim_threshold: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)
    if trim_threshold == RETURNED_BLOCKS:
        libc.malloc_trim(0)


def return_freed_tensors() -> None:
    """Every freed block over 128 KiB goes back to the system: the process holds what it uses, which is
    what the memory planner predicts (a 44M-parameter ZeRO-1 run peaked at 1.40 GiB, against 1.71
    with glibc's own thresholds), at the price of page faults on every block allocated again."""
    _set(RETURNED_BLOCKS, RETURNED_BLOCKS)


def keep_freed_blocks() -> None:
    """Freed blocks (up to 2 GiB) stay in the heap for the next step's (or position's) tensors."""
    _set(KEPT_BLOCKS, KEPT_TRIM)


CPU_HEAPS = {"keep": keep_freed_blocks, "return": return_freed_tensors}  # train.cpu_heap's choices
_training_heap = "keep"


def set_training_heap(choice: str) -> None:
    """The heap a training process runs with (train.cpu_heap); decoding inside it comes back to it."""
    global _training_heap
    _training_heap = choice
    CPU_HEAPS[choice]()


def decoding_env() -> dict[str, str]:
    """keep_freed_blocks' settings for a child process (glibc reads them at start-up)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(KEPT_BLOCKS), "MALLOC_TRIM_THRESHOLD_": str(KEPT_TRIM)}


@contextmanager
def heap_for_decoding() -> Iterator[None]:
    """Decoding inside a training process on CPUs: blocks stay in the heap while it runs, then the
    training heap's setting comes back."""
    if torch.cuda.is_available():
        yield
        return
    keep_freed_blocks()
    try:
        yield
    finally:
        CPU_HEAPS[_training_heap]()
