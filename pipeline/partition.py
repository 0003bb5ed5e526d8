"""Splitting the spec list into pipeline stages by estimated compute, not by layer count.

A decoder layer (self-attention, cross-attention, FFN) costs about 1.4-1.5 times an encoder layer,
and the output projection over the vocabulary can cost several layers, so equal layer counts
leave the decoder's stages slower, and every other stage waits for them.
"""

from __future__ import annotations

import itertools

from deepspeed.pipe import PipelineModule
from deepspeed.runtime.utils import partition_balanced

from model.config import ModelConfig
from pipeline.layers import DecoderLayerPipe, EncoderLayerPipe, OutputProjectionPipe, layer_specs, project_output

# Attention scores cost ~2 L d multiply-adds per token and attention; L is not known when the stages
# are cut, so a typical sentence length stands in.
NOMINAL_LENGTH = 32


def layer_costs(cfg: ModelConfig) -> list[float]:
    """Forward multiply-adds per token of every pipeline layer: a Transformer layer's projections
    (4 d^2 per attention, 2 d f for the FFN) and attention scores; the output projection's vocab x d.
    Embedding lookups and LayerNorms are negligible next to them."""
    d, f = cfg.embed_dim, cfg.ffn_dim
    attention = 4 * d * d + 2 * NOMINAL_LENGTH * d
    ffn = 2 * d * f
    costs = []
    for _, spec in layer_specs(cfg):
        if spec.typename is EncoderLayerPipe:
            costs.append(attention + ffn)
        elif spec.typename is DecoderLayerPipe:
            costs.append(2 * attention + ffn)
        elif spec.typename is OutputProjectionPipe or getattr(spec, "forward_fn", None) is project_output:
            costs.append(cfg.tgt_vocab_size * d)
        else:
            costs.append(0)
    return costs


def stage_bounds(cfg: ModelConfig, stages: int) -> list[int]:
    """Spec indices where each stage starts (and the end), as DeepSpeed cuts them from the costs."""
    return partition_balanced(weights=layer_costs(cfg), num_parts=stages)


def stage_costs(cfg: ModelConfig, stages: int) -> list[float]:
    costs, bounds = layer_costs(cfg), stage_bounds(cfg, stages)
    return [sum(costs[start:stop]) for start, stop in itertools.pairwise(bounds)]


class CostBalancedPipeline(PipelineModule):
    """DeepSpeed's balanced partitioning ('parameters') fed with `layer_costs` instead of parameter
    counts, which would put the embedding tables' lookups on a par with matrix products (and builds
    every layer on every rank just to count them)."""

    def __init__(self, *args, model: ModelConfig, **kwargs):
        self.costs = layer_costs(model)  # read by the partitioning inside PipelineModule.__init__
        super().__init__(*args, partition_method="parameters", **kwargs)

    def _count_layer_params(self) -> list[float]:
        return list(self.costs)
