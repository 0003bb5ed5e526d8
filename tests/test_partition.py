"""Pipeline stages cut by estimated compute (pipeline/parts/stage_cuts.py)."""

import itertools

import pytest
from deepspeed.runtime.utils import partition_balanced

from fathom.model import ModelConfig
from fathom.model.parts import model_parts
from fathom.pipeline.parts.specs import layer_specs
from fathom.pipeline.parts.stage_cuts import balanced_bounds, cut_stages, layer_costs, stage_bounds
from fathom.pipeline.parts.stage_modules import TRANSFORMER_LAYERS


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
    counted = [int(spec.typename.__name__ in TRANSFORMER_LAYERS) for spec in layer_specs(cfg)]
    costs = layer_costs(cfg)
    return [sum(costs[a:b]) for a, b in itertools.pairwise(partition_balanced(weights=counted, num_parts=stages))]


@pytest.mark.parametrize("share", [False, True])
def test_costs_by_hand(share):
    """d 8, f 32, vocab 10: encoder 4*64 + 2*32*8 + 2*8*32 = 1280; the decoder's cross-attention adds
    4*64 + 2*32*8 = 768; the output projection 10 * 8 and the loss 10 * 100, tied to the embedding or
    not; lookups 0."""
    cfg = config(2, 8, 32, 10, share_all_embeddings=share)
    # encoder embedding, 2 encoder layers, decoder embedding, 2 decoder layers, output projection
    assert layer_costs(cfg) == [0, 1280, 1280, 0, 2048, 2048, 1080]


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("cfg", [config(12, 64, 256, 20), config(12, 256, 1024, 8008)], ids=["default", "multi30k"])
def test_mixed_model_is_balanced_by_cost_not_by_layer_count(cfg, stages):
    """The default job's shape (12L-12L, d 64) and the Multi30k recipe's widths and vocabulary."""
    costs = cut_stages(cfg, stages)[1]  # each stage's cost
    assert imbalance(costs) <= 1.10
    assert imbalance(costs) < imbalance(by_layer_count(cfg, stages))


def slowest_stage_by_brute_force(costs: list[int], stages: int, required: list[bool]) -> int:
    cuts = itertools.combinations(range(1, len(costs)), stages - 1)
    stages = [list(itertools.pairwise([0, *cut, len(costs)])) for cut in cuts]
    return min(max(sum(costs[a:b]) for a, b in s) for s in stages if all(any(required[a:b]) for a, b in s))


@pytest.mark.parametrize(
    "costs", [[5, 1, 1, 1, 5], [0, 3, 3, 0, 4, 4, 9], [1] * 7, [0, 0, 0, 10], [7, 0, 2, 2, 2, 0, 1]]
)
@pytest.mark.parametrize("marked", ["all", "inner"])
def test_balanced_bounds_cut_the_optimal_stages(costs, marked):
    """Optimal bottleneck, every stage holding a required layer (all; or all but the two ends, like
    the embedding and output layers around the Transformer layers)."""
    required = [marked == "all" or 0 < i < len(costs) - 1 for i in range(len(costs))]
    for stages in range(1, sum(required) + 1):
        bounds = balanced_bounds(costs, stages, required)
        assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == stages + 1
        assert all(any(required[a:b]) for a, b in itertools.pairwise(bounds)), "every stage holds a required layer"
        slowest = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        assert slowest == slowest_stage_by_brute_force(costs, stages, required)


def test_every_stage_holds_a_transformer_layer():
    """A small model with a large vocabulary: by cost alone the output layer would be a stage of its own."""
    cfg = config(2, 32, 64, 5000, share_all_embeddings=True)
    specs = [spec.typename.__name__ in TRANSFORMER_LAYERS for spec in layer_specs(cfg)]
    assert balanced_bounds(layer_costs(cfg), 2)[1] == len(specs) - 1  # the unconstrained cut
    for stages in (2, 3, 4):
        bounds = stage_bounds(cfg, stages)
        assert all(any(specs[a:b]) for a, b in itertools.pairwise(bounds))


def test_balanced_bounds_match_deepspeeds_slowest_stage_and_take_milliseconds():
    """DeepSpeed's partition_balanced minimizes max - min in O(n^2 m) Python; the slowest stage is what
    the pipeline waits for, and ours is never slower."""
    costs = layer_costs(config(30, 64, 256, 1000))
    for stages in (2, 3, 8):
        ours = balanced_bounds(costs, stages)
        theirs = partition_balanced(weights=costs, num_parts=stages)
        slowest = [max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)) for bounds in (ours, theirs)]
        assert slowest[0] <= slowest[1]


@pytest.mark.parametrize("share", ["none", "decoder", "all"])
def test_only_tied_reuses_have_no_checkpoint_file(share):
    """A part's name says which module its checkpoint file loads into; DeepSpeed saves a tied table under
    its first use only, and those re-uses (specs with a forward_fn) are the parts marked not saved."""
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=2, embed_dim=8, ffn_dim=16, attention_heads=2, src_vocab_size=16,
        tgt_vocab_size=16, share_all_embeddings=share == "all", share_decoder_input_output_embed=share == "decoder",
    )  # fmt: skip
    parts = model_parts(cfg)
    assert [not part.saved for part in parts] == [
        getattr(spec, "forward_fn", None) is not None for spec in layer_specs(cfg)
    ]
    assert sum(not part.saved for part in parts) == {"none": 0, "decoder": 1, "all": 2}[share]
