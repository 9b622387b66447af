"""Custom ops (torch.library): window-attention saliency and KV-cache compaction.

Each op has a plain-aten CPU reference and a Triton kernel used on CUDA; Triton is imported
lazily, so the package works where it is absent. See docs/ops.md.
"""
from .compaction import compact_kv, compact_kv_reference
from .saliency import window_scores, window_scores_naive, window_scores_reference

__all__ = ["compact_kv", "compact_kv_reference", "window_scores", "window_scores_naive", "window_scores_reference"]
