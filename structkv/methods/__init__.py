"""KV-compression methods as small dataclasses in a registry: `structkv.methods.get("snapkv", kv_budget=0.1)`.

Each method answers the prefill loop's questions through a few hooks (`Method`); the loop
(`structkv.runtime.compress`) does the mechanics and names no method. One file per method family
(`snapkv` holds SnapKV and PyramidKV, `kvzip` KVzip with its retention and reconstruction scores,
`gemfilter` GemFilter with its restarting propagation); `registry` names them and their variants.
Budgets are a ratio in (0, 1] of each row's prompt length or an absolute token count. Depth
defaults (TSP / filter layer) are fractions of the model's depth so they carry across models.
"""
from ..modules.budget import Budget
from .base import Layout, Method, restarts
from .fastkv import FastKV
from .full import Full
from .gemfilter import GemFilter
from .h2o import H2O
from .keydiff import KeyDiff
from .kvzip import KVzip
from .registry import (
                       CONTEXT_ARCHIVE,
                       CONTEXT_DEFAULTS,
                       METHODS,
                       build,
                       check_budgets,
                       context_archive,
                       context_default,
                       get,
                       has_struct_budget,
                       model_kind,
                       names,
                       register,
                       takes,
)
from .snapkv import PyramidKV, SnapKV
from .streaming_llm import StreamingLLM
from .structkv import StructKV

__all__ = ["Budget", "CONTEXT_ARCHIVE", "CONTEXT_DEFAULTS", "Layout", "METHODS", "FastKV", "Full", "GemFilter", "H2O",
           "KVzip", "KeyDiff", "Method", "PyramidKV", "SnapKV", "StreamingLLM", "StructKV", "build", "context_archive",
           "context_default", "get", "has_struct_budget", "model_kind", "names", "register",
           "restarts", "check_budgets", "takes"]

