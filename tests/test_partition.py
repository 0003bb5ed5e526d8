"""Pipeline stages cut by estimated compute (pipeline/partition.py)."""

import itertools

import pytest
from deepspeed.runtime.utils import partition_balanced

from model import ModelConfig
from pipeline.layers import TRANSFORMER_LAYERS, layer_specs
from pipeline.partition import layer_costs, stage_costs


def config(layers: int, dim: int, ffn: int, vocab: int, **kw) -> ModelConfig:
    return ModelConfig(
        encoder_layers=layers,
        decoder_layers=layers,
        embed_dim=dim,
        ffn_dim=ffn,
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        **kw,
    )


def imbalance(costs: list[float]) -> float:
    return max(costs) / (sum(costs) / len(costs))


def by_layer_count(cfg: ModelConfig, stages: int) -> list[float]:
    """Stage costs when every stage gets as many Transformer layers (the former default)."""
    counted = [int(spec.typename.__name__ in TRANSFORMER_LAYERS) for _, spec in layer_specs(cfg)]
    costs = layer_costs(cfg)
    return [sum(costs[a:b]) for a, b in itertools.pairwise(partition_balanced(weights=counted, num_parts=stages))]


@pytest.mark.parametrize("share", [False, True])
def test_costs_by_hand(share):
    """d 8, f 32, vocab 10: encoder 4*64 + 2*32*8 + 2*8*32 = 1280; the decoder's cross-attention adds
    4*64 + 2*32*8 = 768; the output projection 10 * 8, tied to the embedding or not; lookups 0."""
    cfg = config(2, 8, 32, 10, share_all_embeddings=share)
    # encoder embedding, 2 encoder layers, decoder embedding, 2 decoder layers, output projection
    assert layer_costs(cfg) == [0, 1280, 1280, 0, 2048, 2048, 80]


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("cfg", [config(12, 64, 256, 20), config(12, 256, 1024, 8008)], ids=["default", "multi30k"])
def test_mixed_model_is_balanced_by_cost_not_by_layer_count(cfg, stages):
    """The default job's shape (12L-12L, d 64) and the Multi30k recipe's widths and vocabulary."""
    assert imbalance(stage_costs(cfg, stages)) <= 1.10
    assert imbalance(stage_costs(cfg, stages)) < imbalance(by_layer_count(cfg, stages))
