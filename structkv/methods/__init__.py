"""KV-compression methods as small dataclasses in a registry: `structkv.methods.get("snapkv", kv_budget=0.1)`.

Each method answers the prefill loop's questions through a few hooks (`Method`); the loop
(`structkv.compress`) does the mechanics.
Budgets are a ratio in (0, 1] of each row's prompt length or an absolute token count. Depth
defaults (TSP / filter layer) are fractions of the model's depth so they carry across models.
"""
from ..modules.budget import Budget
from .base import Layout, Method
from .registry import (
                       CONTEXT_ARCHIVE,
                       CONTEXT_DEFAULT,
                       METHODS,
                       build,
                       context_archive,
                       get,
                       has_struct_budget,
                       names,
                       register,
)
from .variants import H2O, FastKV, Full, GemFilter, KeyDiff, KVzip, PyramidKV, SnapKV, StreamingLLM, StructKV

__all__ = ["Budget", "CONTEXT_ARCHIVE", "CONTEXT_DEFAULT", "Layout", "METHODS", "FastKV", "Full", "GemFilter", "H2O",
           "KVzip", "KeyDiff", "Method", "PyramidKV", "SnapKV", "StreamingLLM", "StructKV", "build", "context_archive",
           "get", "has_struct_budget", "names", "register"]

