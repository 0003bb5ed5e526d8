"""Admin's two-phase initialization (Liu et al. 2020, Sec. 4.3; Liu et al. 2020b, Sec. 3).

Profiling: the model as built (fairseq's initialization, every omega = 1) runs forward over one
batch, without dropout unless model.admin.profile_dropout (the authors' code profiles in training
mode, with dropout: omegas 4.2% larger on average at dropout 0.1, 6L-6L, docs/INTERNALS.md), and each
sublayer i records Var[f_i(x_{i-1})], the variance of its branch output. Initialization, counted
separately over the encoder's 2N and the decoder's 3M sublayers:

    omega_1 = 1,    omega_i = sqrt(Var[x_0] + sum_{j<i} Var[f_j(x_{j-1})])   for i >= 2

The sum is the variance the residual stream would have without normalization; x_{i-1}, a
LayerNorm output of unit variance, times omega_i restores it. The first sublayer's input is the
embedding x_0 itself, already at that scale, so its omega is 1 and Var[x_0] opens the sum (the
authors' code, Transformer-Clinic, does the same). Variances are taken over all elements of the
batch, pads included, as there.

A profile is a JSON file {"variances": {sublayer: [Var[input], Var[branch]]}, "omegas": {...}},
keyed by the single-process model's module names, so it fits any stage count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

import torch
from torch import nn

from fathom.common.errors import ConfigError
from fathom.common.files import write_atomic
from fathom.common.run_layout import PROFILE_FILE
from fathom.model.layers import SUBLAYERS
from fathom.model.model_config import ModelConfig
from fathom.model.norms import AdminResidual

# sublayer name -> (Var[input], Var[branch output])
Variances = dict[str, tuple[float, float]]


def sublayers(cfg: ModelConfig) -> dict[str, list[str]]:
    """The residual modules of each stack in the order the forward pass meets them."""
    depth = {"encoder": cfg.encoder_layers, "decoder": cfg.decoder_layers}
    return {
        side: [f"{side}.layers.{i}.{sublayer.residual}" for i in range(depth[side]) for sublayer in SUBLAYERS[side]]
        for side in SUBLAYERS
    }


def omegas_from(variances: Variances, cfg: ModelConfig) -> dict[str, float]:
    omegas = {}
    for names in sublayers(cfg).values():
        missing = [name for name in names if name not in variances]
        if missing:
            raise ValueError(f"no variance recorded for {missing[0]} (and {len(missing) - 1} more)")
        total = variances[names[0]][0]
        omegas[names[0]] = 1.0
        for previous, name in pairwise(names):
            total += variances[previous][1]
            omegas[name] = math.sqrt(total)
    return omegas


def admin_residuals(model: nn.Module) -> dict[str, AdminResidual]:
    return {name: m for name, m in model.named_modules() if isinstance(m, AdminResidual)}


@contextmanager
def recording(residuals: dict[str, AdminResidual]) -> Iterator[Variances]:
    """Within the block, the residuals record their variances; the yielded dict holds them after it."""
    record: Variances = {}
    for module in residuals.values():
        module.recording, module.variances = True, None
    try:
        yield record
    finally:
        for name, module in residuals.items():
            module.recording = False
            if module.variances is not None:
                record[name] = module.variances


def apply_omegas(residuals: dict[str, AdminResidual], omegas: dict[str, float]) -> None:
    with torch.no_grad():
        for name, module in residuals.items():
            module.omega.fill_(omegas[name])


@contextmanager
def dropout_during(model: nn.Module, active: bool) -> Iterator[None]:
    """With `active`, dropout applies in the passes inside, even those run in eval mode (DeepSpeed's
    eval_batch sets it): every module is put in training mode as its forward starts. The mode each
    had is restored at the end."""
    modes = {m: m.training for m in model.modules()}

    def training(module: nn.Module, args: tuple) -> None:
        module.training = True

    handles = [m.register_forward_pre_hook(training) for m in model.modules()] if active else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for m, mode in modes.items():
            m.training = mode


def profile(
    model: nn.Module, src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor, dropout: bool = False
) -> Variances:
    """The profiling pass of a single-process Transformer (with `dropout`, as the authors' code runs it)."""
    with recording(admin_residuals(model)) as record, torch.no_grad(), dropout_during(model, dropout):
        model.eval()(src_tokens, prev_output_tokens)
    return record


def save_profile(path: str | Path, variances: Variances, omegas: dict[str, float]) -> None:
    """Written whole or not at all: a crash mid-write leaves no half profile to reuse."""
    write_atomic(Path(path), json.dumps({"variances": variances, "omegas": omegas}, indent=1) + "\n")


def load_profile(path: str | Path, cfg: ModelConfig) -> dict[str, float]:
    """The omegas of a saved profile, checked against the model's sublayers."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"model.admin.profile: {path} does not exist; give a run's {PROFILE_FILE} or drop the key")
    omegas = json.loads(path.read_text())["omegas"]
    expected = [name for names in sublayers(cfg).values() for name in names]
    if sorted(omegas) != sorted(expected):
        raise ConfigError(
            f"model.admin.profile: {path} profiles {len(omegas)} sublayers, this model has {len(expected)} "
            f"({cfg.encoder_layers}L-{cfg.decoder_layers}L); profile again by dropping the key"
        )
    return omegas
