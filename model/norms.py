"""The registry of residual/normalization schemes.

A scheme alone decides, for every sublayer (self-attention, cross-attention, FFN), how its branch
F is combined with the residual stream and normalized, and how the layer's weights are
initialized on top of fairseq's defaults. Adding a scheme is one registered class below;
layers, pipeline and trainer do not change.

    python scripts/list_schemes.py      # prints the registry as a table (docs/SCHEMES.md's)

Why one file of ~500 lines: the registry is meant to be read, and compared, in one sitting. Each
scheme is one class of 10-40 lines with its residual module and constants beside it; splitting them
apart would scatter the comparison the file exists for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from fathom.common.errors import ConfigError
from fathom.common.sections import APPLIED, START_ONLY, bounds, parse_section
from fathom.model.model_config import ModelConfig

Side = Literal["encoder", "decoder"]
Branch = Callable[[torch.Tensor], torch.Tensor]


class Residual(nn.Module):
    """Joins one sublayer's branch F to the residual stream: each scheme's residual module is one."""

    def forward(self, x: torch.Tensor, branch: Branch, layer_norm: nn.Module) -> torch.Tensor:
        raise NotImplementedError

    def scales(self) -> tuple[float | torch.Tensor, float] | None:
        """(s, b) of LN(s * x + b * F(x)): what export folds into a fairseq Post-LN sublayer (model/fold.py);
        None where there is nothing to fold (Pre-LN's residual is the fairseq model's already)."""
        return None


class PostNorm(Residual):
    """x_{l+1} = LN(residual_scale * x_l + branch_scale * F(x_l))."""

    def __init__(self, residual_scale: float = 1.0, branch_scale: float = 1.0):
        super().__init__()
        # Plain floats, not buffers: a bf16 engine would round a buffer, and they are derived
        # from the config (and the step), so they never belong in a checkpoint.
        self.residual_scale = residual_scale
        self.branch_scale = branch_scale

    def forward(self, x: torch.Tensor, branch: Branch, layer_norm: nn.Module) -> torch.Tensor:
        residual = x if self.residual_scale == 1.0 else self.residual_scale * x
        out = branch(x)
        if self.branch_scale != 1.0:
            out = self.branch_scale * out
        return layer_norm(residual + out)

    def scales(self) -> tuple[float | torch.Tensor, float]:
        return self.residual_scale, self.branch_scale

    def extra_repr(self) -> str:
        return f"residual_scale={self.residual_scale:.6g}, branch_scale={self.branch_scale:.6g}"


class PreNorm(Residual):
    """x_{l+1} = x_l + F(LN(x_l))."""

    def forward(self, x: torch.Tensor, branch: Branch, layer_norm: nn.Module) -> torch.Tensor:
        return x + branch(layer_norm(x))


@dataclass
class Profiling:
    """A scheme whose initialization needs a forward pass over data first (Admin's omegas, model/admin.py;
    through the pipeline, pipeline/engine/admin_profile.py): how a run's start sets it."""

    saved: str | None  # a profile an earlier run wrote: its values, no pass
    dropout: bool  # profile in training mode (dropout on)


class NormScheme:
    """Base class: Post-LN placement, fairseq initialization, no extra parameters. A scheme declares
    its options (Options, the model.<name> section; each option declares what a resume does with a
    change to it, common.sections.OnResume: START_ONLY for one that acts only at a run's start), its
    profiling pass (profiling) and, through its residual modules (Residual.scales), what export folds."""

    name: ClassVar[str]
    formula: ClassVar[str]
    source: ClassVar[str]
    # For the registry table (scripts/list_schemes.py): how weights start, and how the trained
    # model maps onto a plain fairseq Transformer.
    initialization: ClassVar[str] = "fairseq's"
    fairseq_export: ClassVar[str] = "yes, as is"
    # The layout (scheme) a trained model folds into for export to fairseq: post_ln or pre_ln; None: it cannot be.
    fairseq_layout: ClassVar[str | None] = "post_ln"
    # Pre-LN stacks end in a final LayerNorm (fairseq's encoder.layer_norm / decoder.layer_norm).
    normalize_before: ClassVar[bool] = False

    @dataclass
    class Options:
        pass

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.options = parse_section(self.Options, cfg.schemes.get(self.name, {}), f"model.{self.name}")

    def residual(self, side: Side) -> Residual:
        """The module joining one sublayer's branch to the residual stream."""
        return PostNorm()

    def layer_norm(self, dim: int) -> nn.Module:
        """The normalization handed to residual(); schemes without LayerNorm return nn.Identity."""
        return nn.LayerNorm(dim)

    def inner_norm(self, dim: int) -> nn.Module:
        """Normalization inside a branch: before self-attention's out_proj and before fc2 (Sub-LN)."""
        return nn.Identity()

    def init_layer(self, layer: nn.Module, side: Side) -> None:
        """Re-initializes a freshly built layer; fairseq's initialization is already applied."""

    def embedding_scale(self, side: Side) -> float:
        """Factor on the N(0, d^-1/2) initialization of the side's token embedding (T-Fixup)."""
        return 1.0

    def step_metrics(self, step: int) -> dict[str, float]:
        """Step-dependent values worth logging (e.g. BranchNorm's alpha)."""
        return {}

    def profiling(self) -> Profiling | None:
        """The profiling pass a run's start makes before training; None: the scheme needs none."""
        return None

    def fairseq_config(self) -> ModelConfig:
        """The fairseq model this one folds into: same shapes, the `fairseq_layout` scheme."""
        return dataclasses.replace(self.cfg, norm_scheme=self.fairseq_layout, schemes={})


SCHEMES: dict[str, type[NormScheme]] = {}


def register(cls: type[NormScheme]) -> type[NormScheme]:
    SCHEMES[cls.name] = cls
    return cls


def build_scheme(cfg: ModelConfig) -> NormScheme:
    try:
        scheme = SCHEMES[cfg.norm_scheme]
    except KeyError:
        raise ConfigError(
            f"model.norm_scheme: unknown scheme '{cfg.norm_scheme}'; choose one of {', '.join(SCHEMES)}"
        ) from None
    return scheme(cfg)


@register
class PostLN(NormScheme):
    name = "post_ln"
    formula = "x = LN(x + F(x))"
    source = "Vaswani et al. 2017"


@register
class PreLN(NormScheme):
    name = "pre_ln"
    formula = "x = x + F(LN(x)); final LN after each stack"
    source = "Xiong et al. 2020"
    fairseq_export = "yes, with encoder/decoder_normalize_before"
    fairseq_layout = "pre_ln"
    normalize_before = True

    def residual(self, side: Side) -> Residual:
        return PreNorm()


class ReZeroResidual(Residual):
    """x_{l+1} = x_l + w * F(x_l), w a trainable scalar starting at 0, no normalization."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, branch: Branch, layer_norm: nn.Module) -> torch.Tensor:
        return x + self.weight * branch(x)


@register
class ReZero(NormScheme):
    # One w per sublayer (self-attention, cross-attention, FFN), where the ReZero paper's Transformer
    # shares one per layer: the per-branch choice lets a decoder layer open its sublayers separately.
    name = "rezero"
    formula = "x = x + w * F(x), w a scalar per sublayer initialized to 0; no LayerNorm"
    source = "Bachlechner et al. 2020, ReZero"
    initialization = "fairseq's; w = 0"
    fairseq_export = "no: w and the missing LayerNorms need a plugin"
    fairseq_layout = None

    def residual(self, side: Side) -> Residual:
        return ReZeroResidual()

    def layer_norm(self, dim: int) -> nn.Module:
        return nn.Identity()


def variance(t: torch.Tensor) -> float:
    """Population variance over every element, in float64 so stage counts cannot change the sum."""
    return t.detach().double().var(correction=0).item()


class AdminResidual(Residual):
    """x_{l+1} = LN(x_l * omega + F(x_l)), omega a trainable vector over the model dimension.

    While `recording` is set it records (Var[x_l], Var[F(x_l)]); model/admin.py turns the records
    of a whole stack into omegas."""

    def __init__(self, dim: int):
        super().__init__()
        self.omega = nn.Parameter(torch.ones(dim))
        self.recording = False
        self.variances: tuple[float, float] | None = None

    def forward(self, x: torch.Tensor, branch: Branch, layer_norm: nn.Module) -> torch.Tensor:
        out = branch(x)
        if self.recording:
            self.variances = (variance(x), variance(out))
        return layer_norm(x * self.omega + out)

    def scales(self) -> tuple[torch.Tensor, float]:
        """As PostNorm.scales: s = omega."""
        return self.omega.detach(), 1.0


@register
class Admin(NormScheme):
    name = "admin"
    formula = "x = LN(x * omega + F(x)), omega a vector per sublayer set by a profiling pass"
    source = "Liu et al. 2020, Admin; Liu et al. 2020, Very Deep Transformers for NMT"
    initialization = "fairseq's; omega from one profiling batch (or a saved profile)"
    fairseq_export = "yes, omega folded into the LayerNorm before each sublayer (Admin App. C)"

    @dataclass
    class Options:
        # A profile an earlier run wrote (<save_dir>/admin_profile.json): use its omegas, skip profiling.
        profile: str | None = dataclasses.field(default=None, metadata=START_ONLY)
        # Profile with dropout on, as the Admin authors' code does (training mode). Off by default: the
        # omegas then depend on the weights and the batch only, the same at any stage count, and
        # Admin's papers describe the pass as a plain forward pass.
        profile_dropout: bool = dataclasses.field(default=False, metadata=START_ONLY)

    def residual(self, side: Side) -> Residual:
        return AdminResidual(self.cfg.embed_dim)

    def profiling(self) -> Profiling:
        return Profiling(saved=self.options.profile, dropout=self.options.profile_dropout)

    def fairseq_config(self) -> ModelConfig:
        # The first sublayer's omega scales the embedding output, sinusoids included: it folds into
        # the token table and a learned copy of the sinusoids, each stack's own (model/fold.py).
        return dataclasses.replace(
            super().fairseq_config(),
            learned_pos=True,
            share_all_embeddings=False,
            share_decoder_input_output_embed=False,
        )


def deepnorm_constants(
    encoder_layers: int, decoder_layers: int, side: Side, variant: str = "paper"
) -> tuple[float, float]:
    """(alpha, beta) of DeepNet's encoder-decoder table for N encoder and M decoder layers.

    torchscale's code differs from the paper in one constant: its encoder beta is 1.15 (N^4 M)^(-1/16)."""
    n, m = encoder_layers, decoder_layers
    if side == "encoder":
        beta_factor = 1.15 if variant == "torchscale" else 0.87
        return 0.81 * (n**4 * m) ** (1 / 16), beta_factor * (n**4 * m) ** (-1 / 16)
    return (3 * m) ** (1 / 4), (12 * m) ** (-1 / 4)


# DeepNet scales these projections by beta; queries and keys keep gain 1.
BETA_SCALED = ("v_proj", "out_proj", "fc1", "fc2")
UNSCALED = ("q_proj", "k_proj")


def deepnorm_init(layer: nn.Module, beta: float) -> None:
    """DeepNet's init: xavier_normal_ with gain beta on BETA_SCALED, gain 1 on q/k."""
    for name, module in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in BETA_SCALED + UNSCALED:
            nn.init.xavier_normal_(module.weight, gain=beta if leaf in BETA_SCALED else 1.0)


def torchscale_init(layer: nn.Module, factor: float, skip: str | None = None) -> None:
    """torchscale's code: PyTorch's default nn.Linear init for every projection (its attention never
    calls its own xavier reset_parameters), then the weights and biases of BETA_SCALED outside `skip`
    times factor."""
    with torch.no_grad():
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            module.reset_parameters()
            if name.rsplit(".", 1)[-1] in BETA_SCALED and not (skip and name.startswith(skip)):
                module.weight.mul_(factor)
                module.bias.mul_(factor)


DEEPNORM_INITS = {"paper": deepnorm_init, "torchscale": torchscale_init}


@register
class DeepNorm(NormScheme):
    name = "deepnorm"
    formula = "x = LN(alpha * x + F(x)); beta-scaled init of v_proj, out_proj, fc1, fc2"
    source = "Wang et al. 2022, DeepNet"
    initialization = "xavier_normal, gain beta on v_proj, out_proj, fc1, fc2 (or torchscale's: PyTorch default x beta)"
    fairseq_export = "yes, alpha folded into the LayerNorm before each sublayer (model/fold.py)"

    @dataclass
    class Options:
        # "paper": xavier_normal with gain beta (Algorithm 1); "torchscale": that library's code.
        init: Literal["paper", "torchscale"] = dataclasses.field(default="paper", metadata=START_ONLY)

    def residual(self, side: Side) -> Residual:
        alpha, _ = deepnorm_constants(self.cfg.encoder_layers, self.cfg.decoder_layers, side)
        return PostNorm(residual_scale=alpha)

    def init_layer(self, layer: nn.Module, side: Side) -> None:
        _, beta = deepnorm_constants(self.cfg.encoder_layers, self.cfg.decoder_layers, side, self.options.init)
        DEEPNORM_INITS[self.options.init](layer, beta)


def sub_ln_gain(encoder_layers: int, decoder_layers: int, side: Side) -> float:
    """Magneto's encoder-decoder gain gamma, as torchscale computes it."""
    n, m = encoder_layers, decoder_layers
    if side == "encoder":
        return math.sqrt(math.log(3 * m) * math.log(2 * n) / 3)
    return math.sqrt(math.log(3 * m))


@register
class SubLN(PreLN):
    """Pre-LN whose branches normalize once more inside."""

    name = "sub_ln"
    formula = "x = x + F(LN(x)), F with an extra LN before out_proj (self-attention) and before fc2"
    source = "Wang et al. 2022, Foundation Transformers (Magneto); torchscale"
    initialization = "torchscale's: PyTorch default; v_proj, out_proj, fc1, fc2 x gamma (not cross-attention)"
    fairseq_export = "no: the inner LayerNorms need a plugin"
    fairseq_layout = None

    def inner_norm(self, dim: int) -> nn.Module:
        return nn.LayerNorm(dim)

    def init_layer(self, layer: nn.Module, side: Side) -> None:
        # torchscale leaves the decoder's cross-attention at PyTorch's default init.
        gain = sub_ln_gain(self.cfg.encoder_layers, self.cfg.decoder_layers, side)
        torchscale_init(layer, gain, skip="encoder_attn")


def t_fixup_scale(encoder_layers: int, decoder_layers: int, side: Side) -> float:
    """T-Fixup's factor: 0.67 N^(-1/4) in the encoder, (9M)^(-1/4) in the decoder."""
    return 0.67 * encoder_layers ** (-1 / 4) if side == "encoder" else (9 * decoder_layers) ** (-1 / 4)


def t_fixup_init(layer: nn.Module, scale: float) -> None:
    """The authors' code: xavier_uniform FFN with zero bias, then v_proj, out_proj, fc1, fc2 weights
    times scale; v_proj also times sqrt(2), undoing fairseq's 1/sqrt(2) gain to start from xavier."""
    with torch.no_grad():
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if not isinstance(module, nn.Linear) or leaf not in BETA_SCALED:
                continue
            if leaf in ("fc1", "fc2"):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            module.weight.mul_(scale * (math.sqrt(2) if leaf == "v_proj" else 1.0))


@register
class TFixup(NormScheme):
    name = "t_fixup"
    formula = "x = x + F(x), no LayerNorm; v_proj, out_proj, fc1, fc2 and token embeddings scaled at init"
    source = "Huang et al. 2020, T-Fixup; layer6ai-labs/T-Fixup"
    initialization = (
        "xavier; v_proj, out_proj, fc1, fc2 x 0.67 N^-1/4 (enc), (9M)^-1/4 (dec); embeddings x (9N)^-1/4, (9M)^-1/4"
    )
    fairseq_export = "no: without LayerNorm it needs a plugin"
    fairseq_layout = None

    def residual(self, side: Side) -> Residual:
        return PreNorm()  # handed nn.Identity below: x + F(x)

    def layer_norm(self, dim: int) -> nn.Module:
        return nn.Identity()

    def init_layer(self, layer: nn.Module, side: Side) -> None:
        t_fixup_init(layer, t_fixup_scale(self.cfg.encoder_layers, self.cfg.decoder_layers, side))

    def embedding_scale(self, side: Side) -> float:
        # The authors' code scales the encoder's embedding with N (their paper's text says M for both).
        layers = self.cfg.encoder_layers if side == "encoder" else self.cfg.decoder_layers
        return (9 * layers) ** (-1 / 4)


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


# The paper (Sec. 5.1, Fig. 7) shows exp and sigmoid growth only as curves. These closed forms
# have the same shapes and, like the linear rule, are 0 at t=0, reach 1 at t=T and are clipped.
GROWTH: dict[str, Callable[[float], float]] = {
    "linear": lambda u: u,
    "exp": lambda u: math.expm1(5.0 * u) / math.expm1(5.0),
    "sigmoid": lambda u: (_sigmoid(10.0 * (u - 0.5)) - _sigmoid(-5.0)) / (_sigmoid(5.0) - _sigmoid(-5.0)),
}


def branchnorm_alpha(step: int, T: int, growth: str = "linear") -> float:
    """alpha_t of BranchNorm Eq. 8: min(1, t/T) for linear growth, t = completed optimizer steps."""
    return min(1.0, GROWTH[growth](min(step, T) / T))


class BranchScaled(PostNorm):
    """x_{l+1} = LN(x_l + alpha_t * F(x_l)); the step hook moves alpha_t."""

    def __init__(self, schedule: Callable[[int], float]):
        super().__init__(branch_scale=schedule(0))
        self.schedule = schedule
        self.register_buffer("alpha", None, persistent=False)

    def hold_alpha_in_tensor(self, device: torch.device | None = None) -> None:
        """Reads alpha_t from a tensor on `device` at every forward (it moves with the module; set_step
        writes it), for code that records kernels once and replays them (CUDA graphs), which would
        otherwise keep the float of the step it recorded. A bf16 model multiplies by alpha_t rounded to bf16."""
        self.alpha = torch.tensor(self.branch_scale, device=device)

    def set_step(self, step: int) -> None:
        self.branch_scale = self.schedule(step)
        if self.alpha is not None:
            self.alpha.fill_(self.branch_scale)

    def forward(self, x: torch.Tensor, branch: Branch, layer_norm: nn.Module) -> torch.Tensor:
        if self.alpha is None:
            return super().forward(x, branch, layer_norm)
        return layer_norm(x + branch(x) * self.alpha)


@register
class BranchNorm(NormScheme):
    name = "branchnorm"
    formula = "x = LN(x + alpha_t * F(x)), alpha_t = min(1, t/T)"
    source = "Liu et al. 2023, BranchNorm"
    initialization = "DeepNorm's (default) or fairseq's"
    fairseq_export = "yes, alpha_t folded into out_proj and fc2"

    @dataclass
    class Options:
        T: int = dataclasses.field(default=4000, metadata=APPLIED | bounds(1))
        growth: Literal["linear", "exp", "sigmoid"] = dataclasses.field(default="linear", metadata=APPLIED)
        # Sec. 4.1: "We initialize model parameters following DeepNorm".
        init: Literal["deepnorm", "fairseq"] = dataclasses.field(default="deepnorm", metadata=START_ONLY)

    def alpha(self, step: int) -> float:
        return branchnorm_alpha(step, self.options.T, self.options.growth)

    def residual(self, side: Side) -> Residual:
        return BranchScaled(self.alpha)

    def init_layer(self, layer: nn.Module, side: Side) -> None:
        if self.options.init == "deepnorm":
            _, beta = deepnorm_constants(self.cfg.encoder_layers, self.cfg.decoder_layers, side)
            deepnorm_init(layer, beta)

    def step_metrics(self, step: int) -> dict[str, float]:
        return {"alpha": self.alpha(step)}
