"""Model loading and the self-contained decoder."""
from .config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from .decoder import Decoder
from .kv_cache import LayerKVCache, StaticKVCache
from .loading import load

__all__ = ["SUPPORTED_ARCHITECTURES", "Decoder", "LayerKVCache", "ModelConfig", "RopeConfig", "StaticKVCache", "load"]
