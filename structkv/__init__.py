"""structkv: structure-aware KV-cache compression (StructKV and its baselines) for long-context LLMs."""
from . import methods, models, modules, ops
from .generation import GenerationResult, generate
from .methods import FastKV, Full, GemFilter, H2O, PyramidKV, SnapKV, StreamingLLM, StructKV
from .models import load
from .prefill import CompressedState

__version__ = "0.1.0"
__all__ = ["CompressedState", "FastKV", "Full", "GemFilter", "GenerationResult", "H2O", "PyramidKV", "SnapKV",
           "StreamingLLM", "StructKV", "generate", "load", "methods", "models", "modules", "ops"]
