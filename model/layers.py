"""Attention and the encoder/decoder layers, with fairseq's parameter names.

Each sublayer's residual connection and normalization come from the configured norm scheme
(model/norms.py); the layers only say what the branches compute. SUBLAYERS names each sublayer's
modules once, for what walks a layer from outside (Admin's profile, export's fold).
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fathom.model.cache import AttentionCache, KeysValues, LayerCache
from fathom.model.dropout import Dropout
from fathom.model.model_config import PAD, ModelConfig
from fathom.model.norms import NormScheme, Side


def key_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Boolean mask broadcastable over (batch, heads, queries, keys): True where a key is a real token."""
    return tokens.ne(PAD)[:, None, None, :]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float, causal: bool
) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim), masked) v, with dropout on the attention probabilities.

    torch's fused kernel (scaled_dot_product_attention) is the fastest on GPUs and in fp32 on CPUs, but
    on a CPU it runs bf16 at a third of the speed of two bf16 matmuls around a float32 softmax
    (docs/BENCHMARKS.md), so bf16 on a CPU takes the matmuls."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.size(-1) ** -0.5
    if causal:  # SDPA's is_causal: query i sees keys 0..i
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(probs, dropout) if dropout else probs, v)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, inner_attn_ln: nn.Module | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.inner_attn_ln = inner_attn_ln if inner_attn_ln is not None else nn.Identity()
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        # fairseq's initialization
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        return x.view(batch, length, self.num_heads, dim // self.num_heads).transpose(1, 2)

    def keys_values(self, key_value: torch.Tensor) -> KeysValues:
        return self._heads(self.k_proj(key_value)), self._heads(self.v_proj(key_value))

    def forward(
        self,
        query: torch.Tensor,
        key_value: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        """With a cache, keys and values already computed for earlier positions (or the source) are reused.

        key_value (and mask) may hold one row per group of consecutive query rows: in beam search, a
        sentence's beams attend over one copy of its source."""
        q = self._heads(self.q_proj(query))
        k, v = self.keys_values(key_value) if cache is None else cache.update(self.keys_values, key_value)
        rows, heads, length, head_dim = q.shape
        sources = k.size(0)
        if sources != rows:  # the group's queries side by side: (sources, heads, group x length, head_dim)
            q = q.view(sources, rows // sources, heads, length, head_dim).transpose(1, 2).flatten(2, 3)
        out = attention(q, k, v, mask, self.dropout if self.training else 0.0, causal)
        if sources != rows:  # back to (rows, length, heads, head_dim)
            out = out.view(sources, heads, rows // sources, length, head_dim).permute(0, 2, 3, 1, 4)
        else:
            out = out.transpose(1, 2)
        return self.out_proj(self.inner_attn_ln(out.reshape(rows, length, heads * head_dim)))


@dataclass(frozen=True)
class Sublayer:
    """One sublayer of a layer by its modules' names: `name`_residual joins its branch to the residual
    stream with `layer_norm` (fairseq's name); `inputs` are the projections reading the stream, `output`
    the branch's last projection."""

    name: str
    layer_norm: str
    inputs: tuple[str, ...]
    output: str

    @property
    def residual(self) -> str:
        return f"{self.name}_residual"


SELF_ATTN = Sublayer("self_attn", "self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "self_attn.out_proj")  # fmt: skip
ENCODER_ATTN = Sublayer("encoder_attn", "encoder_attn_layer_norm", ("encoder_attn.q_proj",), "encoder_attn.out_proj")
FFN = Sublayer("ffn", "final_layer_norm", ("fc1",), "fc2")
# Each side's sublayers in the order the forward pass meets them.
SUBLAYERS: dict[Side, tuple[Sublayer, ...]] = {"encoder": (SELF_ATTN, FFN), "decoder": (SELF_ATTN, ENCODER_ATTN, FFN)}


class TransformerLayer(nn.Module):
    """Self-attention, cross-attention (decoder only) and FFN sublayers, each joined to the residual
    stream by the norm scheme's residual module; `scheme` is the model's (build_scheme(cfg), built once
    for all its layers)."""

    side: ClassVar[Side]

    def __init__(self, cfg: ModelConfig, scheme: NormScheme):
        super().__init__()
        dim, side = cfg.embed_dim, self.side
        self.self_attn = MultiheadAttention(dim, cfg.attention_heads, cfg.attention_dropout, scheme.inner_norm(dim))
        self.self_attn_layer_norm = scheme.layer_norm(dim)
        self.self_attn_residual = scheme.residual(side)
        if side == "decoder":
            self.encoder_attn = MultiheadAttention(dim, cfg.attention_heads, cfg.attention_dropout)
            self.encoder_attn_layer_norm = scheme.layer_norm(dim)
            self.encoder_attn_residual = scheme.residual(side)
        self.fc1 = nn.Linear(dim, cfg.ffn_dim)
        self.ffn_layernorm = scheme.inner_norm(cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, dim)
        self.final_layer_norm = scheme.layer_norm(dim)
        self.ffn_residual = scheme.residual(side)
        self.dropout = Dropout(cfg.dropout)
        self.activation_dropout = Dropout(cfg.activation_dropout)
        scheme.init_layer(self, side)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.ffn_layernorm(self.activation_dropout(F.relu(self.fc1(x))))))


class EncoderLayer(TransformerLayer):
    side = "encoder"

    def forward(self, x: torch.Tensor, src_tokens: torch.Tensor) -> torch.Tensor:
        mask = key_mask(src_tokens)
        x = self.self_attn_residual(x, lambda h: self.dropout(self.self_attn(h, h, mask)), self.self_attn_layer_norm)
        return self.ffn_residual(x, self.ffn, self.final_layer_norm)


class DecoderLayer(TransformerLayer):
    side = "decoder"

    def forward(
        self, x: torch.Tensor, encoder_out: torch.Tensor, src_tokens: torch.Tensor, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """With a cache, x is the newest target position only and attends over the cached prefix."""
        self_cache, encoder_cache = (None, None) if cache is None else (cache.self_attn, cache.encoder_attn)
        # Targets are right-padded, so the causal mask alone keeps real queries off pad keys; one new
        # position attends over its whole cached prefix.
        x = self.self_attn_residual(
            x,
            lambda h: self.dropout(self.self_attn(h, h, causal=cache is None, cache=self_cache)),
            self.self_attn_layer_norm,
        )
        mask = key_mask(src_tokens)
        x = self.encoder_attn_residual(
            x,
            lambda h: self.dropout(self.encoder_attn(h, encoder_out, mask, cache=encoder_cache)),
            self.encoder_attn_layer_norm,
        )
        return self.ffn_residual(x, self.ffn, self.final_layer_norm)


def compiler_missing() -> str | None:
    """What torch.compile's inductor lacks to build kernels on this machine, or None: Triton on a GPU,
    a C++ compiler on a CPU."""
    if torch.cuda.is_available():
        return None if importlib.util.find_spec("triton") else "Triton is not installed (pip install triton)"
    cxx = os.environ.get("CXX", "g++")
    return None if shutil.which(cxx) else f"no C++ compiler {cxx!r} on PATH (apt-get install g++)"


def compile_layers(model: nn.Module) -> int:
    """Compiles the forward of every Transformer layer inside `model` with torch.compile (inductor), in
    place; returns how many. Only forward is compiled: hooks stay eager, and parameter names, state dicts
    and checkpoints do not change. Layers of one class share their compiled code (torch compiles a
    module's parameters as inputs), so a deep stack compiles each kind of layer once per shape."""
    layers = [module for module in model.modules() if isinstance(module, TransformerLayer)]
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return len(layers)
