"""KV-compression methods as small dataclasses in a registry: `structkv.methods.get("snapkv", kv_budget=0.1)`.

Each method answers the prefill loop's questions through a few hooks (`Method`); the loop
(`structkv.compress`) does the mechanics.
Budgets are a ratio in (0, 1] of each row's prompt length or an absolute token count. Depth
defaults (TSP / filter layer) are fractions of the model's depth so they carry across models.
"""
from .base import Layout, Method
from .registry import METHODS, budget_options, get, names, register, struct_budget_option
from .variants import H2O, FastKV, Full, GemFilter, PyramidKV, SnapKV, StreamingLLM, StructKV

__all__ = ["Layout", "METHODS", "FastKV", "Full", "GemFilter", "H2O", "Method", "PyramidKV", "SnapKV", "StreamingLLM",
           "StructKV", "budget_options", "calibrate", "get", "names", "register", "struct_budget_option"]


def calibrate(model, prompts, method=None):
    """StructKV with its pivot fixed from `prompts` (`structkv.methods.calibration`); imported on
    use, as it runs the prefill loop, which itself needs this package."""
    from .calibration import calibrate as run

    return run(model, prompts, method)
