"""The pipeline model as one flat list of LayerSpecs: model/parts.py's parts in their flat form.

A LayerSpec builds its module only on the rank whose stage holds it; a TiedLayerSpec shares one
module between the stages that use it (the embedding tables the config shares) and DeepSpeed
keeps its copies in step.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from model.model_config import ModelConfig
from model.parts import Part, model_parts


def layer_spec(part: Part) -> LayerSpec:
    if part.tie is None:
        return LayerSpec(part.flat, *part.args, **part.flat_kwargs)
    return TiedLayerSpec(part.tie, part.flat, *part.args, forward_fn=part.tied_forward, **part.flat_kwargs)


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """The spec of every part of the model, in forward order; index i is DeepSpeed's layer i."""
    return [layer_spec(part) for part in model_parts(cfg)]
