"""KV-compression methods as small dataclasses in a registry: `structkv.methods.get("snapkv", kv_budget=0.1)`.

Each method states what it does; the shared prefill loop (`structkv.prefill`) does the mechanics.
Budgets are a ratio in (0, 1] of each row's prompt length or an absolute token count. Depth
defaults (TSP / filter layer) are fractions of the model's depth so they carry across models.
"""
from .base import Method
from .registry import METHODS, STRUCT_BUDGET_OPTION, budget_options, get, names
from .variants import FastKV, Full, GemFilter, H2O, PyramidKV, SnapKV, StreamingLLM, StructKV

__all__ = ["METHODS", "FastKV", "Full", "GemFilter", "H2O", "Method", "PyramidKV", "SnapKV", "StreamingLLM",
           "StructKV", "STRUCT_BUDGET_OPTION", "budget_options", "get", "names"]
