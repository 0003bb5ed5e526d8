"""fairseq's label-smoothed cross-entropy: per target token, and its mean over a micro-batch's tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fathom.model.model_config import PAD


def token_losses(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float = 0.1, padding_idx: int = PAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """(label-smoothed loss, nll) of every real (non-pad) target token, as fairseq's
    label_smoothed_nll_loss: (1 - eps - eps_i) * nll + eps_i * sum_v(-log p_v), eps_i = eps / (V - 1)."""
    lprobs = F.log_softmax(logits.float(), dim=-1).flatten(0, -2)
    target = target.flatten()
    keep = target.ne(padding_idx)
    lprobs, target = lprobs[keep], target[keep]
    nll = -lprobs.gather(1, target[:, None]).squeeze(1)
    smooth = -lprobs.sum(dim=-1)
    eps_i = smoothing / (lprobs.size(-1) - 1)
    return (1.0 - smoothing - eps_i) * nll + eps_i * smooth, nll


def label_smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float = 0.1, padding_idx: int = PAD
) -> torch.Tensor:
    """Mean over real target tokens of the label-smoothed loss: a micro-batch's training loss."""
    return token_losses(logits, target, smoothing, padding_idx)[0].mean()
