"""Folding a trained model's scheme-specific scalings into a fairseq Post-LN / Pre-LN Transformer.

Every Post-LN-family sublayer computes LN(s * x + b * F(x)), (s, b) given by its residual's
`scales()` (s: DeepNorm's alpha, Admin's omega vector, else 1; b: BranchNorm's alpha_t, else 1):
- b goes into the branch's last projection (out_proj, fc2).
- s (Admin, appendix C): the module that produced x, the previous LayerNorm or, for a stack's
  first sublayer, an embedding with learned positions and its own table (Admin's fairseq_config),
  multiplies its output by s, and the projections that read x divide their inputs by s, so F
  still sees x. Exact.
- A scalar s behind the embedding (DeepNorm's first sublayers): LayerNorm is scale invariant, so
  LN(s * x + F(x)) = LN(x + F(x) / s) with eps / s^2 for eps, and 1 / s goes into the last
  projection too. Exact but for that eps.
Pre-LN residuals have no scales and copy as they are.

The vector case rewrites the module before, so a folded module is final only once the next one
has been folded: `folded` hands modules on one behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
from torch import nn

from fathom.common.errors import ConfigError
from fathom.model.embedding import Embedding, sinusoidal_table
from fathom.model.layers import SUBLAYERS, Sublayer, TransformerLayer
from fathom.model.norms import Residual

# An omega entry this close to 0 would put a huge 1/omega into the next projections.
SMALLEST_SCALE = 1e-6


def scale_output(producer: nn.Module | None, scale: float | torch.Tensor) -> None:
    """Multiplies the output of the module that made the residual stream by `scale`."""
    if isinstance(producer, Embedding) and producer.positions is not None:
        producer.weight.mul_(scale)
        producer.positions.weight.mul_(scale)
    elif isinstance(producer, nn.LayerNorm):
        producer.weight.mul_(scale)
        producer.bias.mul_(scale)
    else:  # the scheme's fairseq_config must give its model learned positions
        raise TypeError(f"cannot scale the output of {type(producer).__name__}")


class ScaleFolder:
    """Copies each module of a trained model into its counterpart in the fairseq model, in model order,
    folding the residual scales in on the way."""

    def __init__(self) -> None:
        self.producer: nn.Module | None = None  # whose output the residual stream currently is

    @torch.no_grad()
    def fold(self, original: nn.Module, target: nn.Module) -> None:
        if isinstance(original, Embedding):
            target.weight.copy_(original.weight)
            if target.positions is not None:
                rows, dim = target.positions.weight.shape
                source = original.positions.weight if original.positions is not None else sinusoidal_table(rows, dim)
                target.positions.weight.copy_(source)
        elif isinstance(original, TransformerLayer):
            target_keys = target.state_dict().keys()
            target.load_state_dict({k: v for k, v in original.state_dict().items() if k in target_keys})
            for sublayer in SUBLAYERS[original.side]:
                self._fold_sublayer(target, original.get_submodule(sublayer.residual), sublayer)
                self.producer = target.get_submodule(sublayer.layer_norm)
            return
        else:  # a stack's final LayerNorm (Pre-LN)
            target.load_state_dict(original.state_dict())
        self.producer = target

    def _fold_sublayer(self, target: nn.Module, residual: Residual, sublayer: Sublayer) -> None:
        scales = residual.scales()
        if scales is None:
            return
        stream, branch = scales
        factor = branch
        if isinstance(stream, torch.Tensor) or isinstance(self.producer, nn.LayerNorm):  # exact
            check_invertible(stream)
            scale_output(self.producer, stream)
            for name in sublayer.inputs:
                target.get_submodule(name).weight.div_(stream)
        else:
            # A scalar behind the embedding, whose table may be the tied output projection and whose
            # sinusoids cannot scale: LayerNorm's scale invariance, exact but for its eps.
            factor = branch / stream
        if factor != 1.0:
            projection = target.get_submodule(sublayer.output)
            projection.weight.mul_(factor)
            projection.bias.mul_(factor)


def check_invertible(scale: float | torch.Tensor) -> None:
    smallest = torch.as_tensor(scale).abs().min().item()
    if smallest < SMALLEST_SCALE:
        raise ConfigError(
            f"a residual scale has an entry near 0 ({smallest:.3g}); its reciprocal cannot be folded into a fairseq "
            "Transformer"
        )


Key = TypeVar("Key")


def folded(modules: Iterable[tuple[Key, nn.Module, nn.Module]]) -> Iterator[tuple[Key, nn.Module]]:
    """(key, trained module, fairseq module) in model order -> (key, folded fairseq module), each handed
    on once final: after the next module's fold, which may rescale its output."""
    folder, pending = ScaleFolder(), None
    for key, original, target in modules:
        folder.fold(original, target)
        if pending is not None:
            yield pending
        pending = (key, target)
    if pending is not None:
        yield pending
