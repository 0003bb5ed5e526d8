"""Pure-PyTorch encoder-decoder Transformer for very deep machine translation.

Nothing in this package imports DeepSpeed: `pipeline/` applies pipeline parallelism to these
layers from outside, and the same layer classes make the single-process reference model.
"""

from common.errors import ConfigError
from model.model_config import ModelConfig
from model.norms import SCHEMES, NormScheme, build_scheme, register
from model.transformer import Transformer

__all__ = ["SCHEMES", "ConfigError", "ModelConfig", "NormScheme", "Transformer", "build_scheme", "register"]
