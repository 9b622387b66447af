"""Composable modules of StructKV: centrality, pivot detection, skeleton pruning, budgeted cache,
and `StructKVCompressor`, which joins the first three into StructKV's propagation."""
from .budget import Budget
from .budgeted_cache import BudgetedKVCache, pads_last
from .centrality import CentralityTracker
from .compressor import StructKVCompressor
from .decode_bound import DecodeBound
from .pivot import PivotDetector, PivotTrace, calibrate_pivot, candidate_layers
from .propagation import FixedLayerPropagation, Propagation
from .retention import GuidedRetention, Retention
from .scores import last_query_logits, received_attention
from .selection import budget_tokens, gather_tokens, pool_scores, pooled_saliency, select_tokens
from .skeleton import SkeletonPruner
from .structkv_config import StructKVConfig
from .view import LayerView

__all__ = [
    "Budget", "BudgetedKVCache", "CentralityTracker", "DecodeBound", "FixedLayerPropagation", "GuidedRetention",
    "LayerView",
    "PivotDetector", "PivotTrace", "Propagation", "Retention", "SkeletonPruner",
    "StructKVCompressor", "StructKVConfig",
    "budget_tokens", "calibrate_pivot", "candidate_layers", "gather_tokens", "last_query_logits", "pads_last",
    "pool_scores", "pooled_saliency", "received_attention", "select_tokens"
]
