"""Model loading and the self-contained decoder."""
from .architectures import SUPPORTED_ARCHITECTURES
from .config import ModelConfig, RopeConfig
from .decoder import Decoder
from .kv_cache import LayerKVCache, StaticKVCache
from .loading import load

__all__ = ["SUPPORTED_ARCHITECTURES", "Decoder", "LayerKVCache", "ModelConfig", "RopeConfig", "StaticKVCache", "load"]
