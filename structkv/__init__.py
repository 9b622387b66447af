"""structkv: structure-aware KV-cache compression (StructKV and its baselines) for long-context LLMs."""
from . import methods, models, modules, ops
from .methods import H2O, FastKV, Full, GemFilter, PyramidKV, SnapKV, StreamingLLM, StructKV
from .models import load
from .runtime.calibration import calibrate
from .runtime.compress import CompressedState, MethodPass, compress, compress_shared, prefill, prepare
from .runtime.generation import GenerationResult, generate, generate_states
from .runtime.stats import PrefillStats

__version__ = "0.1.0"
__all__ = ["CompressedState", "FastKV", "Full", "GemFilter", "GenerationResult", "H2O", "MethodPass", "PrefillStats",
           "PyramidKV", "SnapKV", "StreamingLLM", "StructKV", "calibrate", "compress", "compress_shared", "generate",
           "generate_states", "load", "methods", "models", "modules", "ops", "prefill", "prepare"]
