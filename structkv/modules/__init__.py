"""Composable modules of StructKV: centrality, pivot detection, skeleton pruning, budgeted cache."""
from .budgeted_cache import BudgetedKVCache
from .centrality import CentralityTracker
from .pivot import PivotDetector, PivotTrace, calibrate_pivot, candidate_layers
from .selection import budget_tokens, gather_tokens, pads_last, pool_scores, select_tokens
from .skeleton import SkeletonPruner

__all__ = ["BudgetedKVCache", "CentralityTracker", "PivotDetector", "PivotTrace", "SkeletonPruner", "budget_tokens",
           "calibrate_pivot", "candidate_layers", "gather_tokens", "pads_last", "pool_scores", "select_tokens"]
