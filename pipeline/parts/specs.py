"""The pipeline model as one flat list of LayerSpecs: pipeline/parts/stage_modules.py's parts in their pipe form.

A LayerSpec builds its module only on the rank whose stage holds it; a TiedLayerSpec shares one
module between the stages that use it (the embedding tables the config shares) and DeepSpeed
keeps its copies in step.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, TiedLayerSpec

from fathom.common.errors import ConfigError
from fathom.model.model_config import ModelConfig
from fathom.pipeline.config.deepspeed_values import partition_pattern
from fathom.pipeline.config.run_config import RunConfig
from fathom.pipeline.parts.stage_modules import PipePart, pipe_parts


def layer_spec(part: PipePart) -> LayerSpec:
    if part.tie is None:
        return LayerSpec(part.pipe_class, *part.args, **part.kwargs)
    return TiedLayerSpec(part.tie, part.pipe_class, *part.args, forward_fn=part.tied_forward, **part.kwargs)


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """The spec of every part of the model, in forward order; index i is DeepSpeed's layer i."""
    return [layer_spec(part) for part in pipe_parts(cfg)]


def check_partition_layers(cfg: RunConfig) -> None:
    """pipeline.partition type:REGEX matches some layer's class, as DeepSpeed's partitioner looks for it."""
    if (pattern := partition_pattern(cfg.partition)) is None:
        return
    names = {part.pipe_class.__name__ for part in pipe_parts(cfg.model)}
    if not any(pattern.search(name) for name in names):
        raise ConfigError(
            f"pipeline.partition: {cfg.partition!r} matches no layer; the layers are {', '.join(sorted(names))}"
        )
