"""structkv: structure-aware KV-cache compression (StructKV and its baselines) for long-context LLMs."""
from . import models
from .generation import GenerationResult, generate
from .models import load

__version__ = "0.1.0"
__all__ = ["GenerationResult", "generate", "load", "models"]
