"""Pure-PyTorch encoder-decoder Transformer for very deep machine translation.

Nothing in this package imports DeepSpeed: `pipeline/` applies pipeline parallelism to these
layers from outside, and the same layer classes make the single-process reference model.
"""

from fathom.common.errors import ConfigError
from fathom.model.model_config import ModelConfig
from fathom.model.norms import SCHEMES, NormScheme, build_scheme, register
from fathom.model.transformer import Transformer

__all__ = ["SCHEMES", "ConfigError", "ModelConfig", "NormScheme", "Transformer", "build_scheme", "register"]
