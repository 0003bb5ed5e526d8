"""Dropout whose mask costs a third as much on a CPU.

torch's CPU dropout draws its mask with bernoulli_, one random draw per element, which took 8% of a
bf16 training step at d 512 (docs/BENCHMARKS.md). Here each 64-bit random integer is cut into four
16-bit ones, and an element is kept when its 16 bits clear a threshold: a quarter of the draws, and
forward plus backward take about a third of bernoulli_'s time. The kept fraction is 1 - p with p
rounded to a multiple of 2^-16 (at most 7.7e-6 off). Elsewhere (GPUs) torch's fused dropout kernel is
used as it is, and so is torch's dropout inside torch.compile (train.compile): inductor draws its own
random numbers inside the layer's fused kernels, where the mask's random_ would split the compiled
layer into a dozen graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT16_VALUES = 1 << 16
INT16_MIN = -(1 << 15)


def keep_mask(shape: torch.Size, p: float) -> torch.Tensor:
    """Boolean mask of `shape`, each element True with probability 1 - p (p rounded to k / 2^16),
    independently, from torch's CPU generator (so torch.manual_seed decides it)."""
    count = shape.numel()
    # random_(INT64_MIN, None) fills all 64 bits; without `from`, the sign bit of every draw would be 0.
    draws = torch.empty(-(-count // 4), dtype=torch.int64).random_(torch.iinfo(torch.int64).min, None)
    bits = draws.view(torch.int16)[:count].view(shape)
    return bits >= INT16_MIN + round(p * INT16_VALUES)


class Dropout(nn.Module):
    """nn.Dropout: in training, each element is zeroed with probability p and the rest scaled by 1 / (1 - p)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu" or self.p >= 1 or torch.compiler.is_compiling():
            return F.dropout(x, self.p, training=True)
        return x * keep_mask(x.shape, self.p).to(x.dtype).mul_(1 / (1 - self.p))
