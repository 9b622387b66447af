"""structkv: structure-aware KV-cache compression (StructKV and its baselines) for long-context LLMs."""
from . import methods, models, modules, ops
from .compress import CompressedState, compress, prefill
from .generation import GenerationResult, generate, generate_states
from .methods import H2O, FastKV, Full, GemFilter, PyramidKV, SnapKV, StreamingLLM, StructKV
from .models import load
from .shared import compress_shared
from .stats import PrefillStats

__version__ = "0.1.0"
__all__ = ["CompressedState", "FastKV", "Full", "GemFilter", "GenerationResult", "H2O", "PrefillStats", "PyramidKV",
           "SnapKV", "StreamingLLM", "StructKV", "compress", "compress_shared", "generate", "generate_states", "load",
           "methods", "models", "modules", "ops", "prefill"]
