"""Splitting the spec list into pipeline stages by estimated compute, not by layer count.

A decoder layer (self-attention, cross-attention, FFN) costs about 1.4-1.5 times an encoder layer,
and the output projection over the vocabulary can cost several layers, so equal layer counts
leave the decoder's stages slower, and every other stage waits for them.

DeepSpeed's own balanced partitioning (`partition_balanced`) is an O(layers^2 x stages) Python
loop: 2 s for 1000 layers in 2 stages, 77 s in 64, on every rank. The cut here minimizes the
slowest stage exactly in O(layers x log(total cost)).
"""

from __future__ import annotations

import itertools

from fathom.model.model_config import ModelConfig
from fathom.pipeline.engine.internals import ExternallyPartitioned
from fathom.pipeline.parts.stage_modules import TRANSFORMER_LAYERS, DecoderLayerPipe, EncoderLayerPipe, pipe_parts

# Attention scores cost ~2 L d multiply-adds per token and attention; L is not known when the stages
# are cut, so a typical sentence length stands in.
NOMINAL_LENGTH = 32
# Log-softmax and the label-smoothed loss pass over every logit about eight times, forward and
# backward, at memory speed: measured on a 2-core CPU as ~100 multiply-adds' worth per logit (the output
# layer of d 256, vocab 8000 took the time of 2.7 decoder layers; docs/BENCHMARKS.md).
LOSS_COST_PER_LOGIT = 100


def layer_costs(cfg: ModelConfig) -> list[int]:
    """Forward multiply-adds per token of every pipeline layer: a Transformer layer's projections
    (4 d^2 per attention, 2 d f for the FFN) and attention scores; the output projection's vocab x d
    and the loss over its logits.
    Embedding lookups and LayerNorms are negligible next to them."""
    d, f = cfg.embed_dim, cfg.ffn_dim
    attention = 4 * d * d + 2 * NOMINAL_LENGTH * d
    ffn = 2 * d * f
    costs = []
    for part in pipe_parts(cfg):
        if part.pipe_class is EncoderLayerPipe:
            costs.append(attention + ffn)
        elif part.pipe_class is DecoderLayerPipe:
            costs.append(2 * attention + ffn)
        elif part.name == "decoder.output_projection":
            costs.append(cfg.tgt_vocab_size * (d + LOSS_COST_PER_LOGIT))
        else:
            costs.append(0)
    return costs


def _greedy_bounds(costs: list[int], stages: int, limit: int, required: list[bool]) -> list[int] | None:
    """Stages filled left to right up to `limit` each, every stage keeping at least one required
    layer; None when `stages` stages cannot hold them all."""
    bounds, load, has_required = [0], 0, False
    left = sum(required)  # required layers from i on
    for i, cost in enumerate(costs):
        # the required layers from here on are as many as the stages still to open: one each
        must_cut = required[i] and left == stages - len(bounds)
        if has_required and (load + cost > limit or must_cut):
            if len(bounds) == stages:
                return None
            bounds.append(i)
            load, has_required = 0, False
        load += cost
        has_required |= required[i]
        left -= required[i]
    return [*bounds, len(costs)] if load <= limit and len(bounds) == stages and has_required else None


def balanced_bounds(costs: list[int], stages: int, required: list[bool] | None = None) -> list[int]:
    """Where each of `stages` contiguous stages starts (and the end), each holding at least one
    `required` layer (default: any), minimizing the costliest stage: a bisection on that cost, each
    probe a greedy left-to-right fill."""
    required = required or [True] * len(costs)
    if not 1 <= stages <= sum(required):
        raise ValueError(f"cannot cut {sum(required)} required layers into {stages} stages")
    low, high = max(costs) - 1, sum(costs)  # infeasible, feasible
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if _greedy_bounds(costs, stages, mid, required) else (mid, high)
    return _greedy_bounds(costs, stages, high, required)


def cut_stages(cfg: ModelConfig, stages: int) -> tuple[list[int], list[int]]:
    """Spec indices where each stage starts (and the end), and each stage's cost. Every stage holds a
    Transformer layer: a stage of only the output layer idles through most of the step (and its
    tied-embedding-only processes crashed at exit in DeepSpeed 0.19)."""
    costs = layer_costs(cfg)
    layers = [part.pipe_class.__name__ in TRANSFORMER_LAYERS for part in pipe_parts(cfg)]
    bounds = balanced_bounds(costs, stages, layers)
    return bounds, [sum(costs[start:stop]) for start, stop in itertools.pairwise(bounds)]


def stage_bounds(cfg: ModelConfig, stages: int) -> list[int]:
    return cut_stages(cfg, stages)[0]


class CostBalancedPipeline(ExternallyPartitioned):
    """A PipelineModule whose stages are cut by `stage_bounds` (and which prints one line per stage
    rather than DeepSpeed's line per layer)."""

    def __init__(self, *args, model: ModelConfig, **kwargs):
        self.model_config = model  # read by bounds() inside PipelineModule.__init__
        super().__init__(*args, **kwargs)

    def bounds(self) -> list[int]:
        bounds, costs = cut_stages(self.model_config, self.num_stages)
        if self.global_rank == 0:
            mean = sum(costs) / len(costs)
            for stage, (start, stop) in enumerate(itertools.pairwise(bounds)):
                print(
                    f"fathom: stage {stage}: layers {start}-{stop - 1} ({stop - start}), "
                    f"estimated compute {costs[stage] / mean:.3f} x mean",
                    flush=True,
                )
        return bounds
