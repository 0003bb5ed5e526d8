"""train.cpu_heap: what glibc does with a CPU training process's freed tensors (common/heap.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

# Allocates 200 MiB as argv[2] tensors (200 of 1 MiB, or one: ZeRO's flat buffers are such blocks),
# frees them, and prints how much of it the process still holds; a validation pass's decoding
# (heap_for_decoding) runs first, and must hand the training choice back.
FREED_AND_HELD = textwrap.dedent(
    """
    import sys
    import torch
    from fathom.common.heap import heap_for_decoding, set_training_heap

    def resident_mib():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / 2**20

    set_training_heap(sys.argv[1])
    with heap_for_decoding():
        torch.ones(1 << 20).sum()
    blocks = int(sys.argv[2])
    before = resident_mib()
    tensors = [torch.ones((200 // blocks) << 18) for _ in range(blocks)]
    del tensors
    print(resident_mib() - before)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [200, 1])
@pytest.mark.parametrize("choice, held", [("keep", (150, 260)), ("return", (-50, 50))])
def test_freed_tensors_stay_in_the_heap_or_go_back_to_the_system(choice, held, blocks):
    """With "keep" the 200 MiB just freed stay resident for the next step's tensors (no page faults),
    in small blocks and in one large one; with "return" they go back to the system, so the process holds
    what it uses, as the planner predicts."""
    result = subprocess.run(
        [sys.executable, "-c", FREED_AND_HELD, choice, str(blocks)], cwd=ROOT, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    low, high = held
    assert low <= float(result.stdout) <= high, result.stdout
