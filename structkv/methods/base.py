"""The Method base class: budgets, validation and the hooks the prefill loop calls.

A method answers the loop's questions itself (`structkv.compress`, docs/methods.md):
- `kv_plan(layout, lengths)`: which layers select their KV entries, and how many per row;
- `kv_scores(view)`: at such a layer, the scores (B, H, n) that choose the entries (the window
  is always kept on top, `select_tokens`);
- `propagation(layout, lengths)`: an optional `Propagation` that observes every layer and may keep
  only some tokens for the deeper layers (FastKV, StructKV) or restart on them (GemFilter);
- `prefill_key()`: methods with equal keys compute the same hidden states (one shared lane).
A new method is a small dataclass overriding these, plus a line in the registry.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..modules.budget import check as check_budget
from ..modules.selection import budget_tokens

# The two budgets every harness speaks in: R_KV (entries kept per layer) and R_struct (tokens that
# go on past the propagation layer). Each is a `Budget`: a ratio in (0, 1] or a token count.
BUDGETS = ("kv_budget", "struct_budget")


def resolve_layer(depth: float | int, layout, scored: list[int], what: str) -> int:
    """A layer index from an int, or from a depth fraction (float in [0, 1]) of the model.

    Methods that score at that layer need a full-attention layer: on hybrid models the nearest
    one (excluding the last layer) is taken, deeper on ties.
    """
    L = layout.num_layers
    if isinstance(depth, bool) or not isinstance(depth, (int, float)):
        raise ValueError(f"{what} must be a layer index (int) or a depth fraction (float), got {depth!r}")
    if isinstance(depth, float):
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"{what} fraction must be in [0, 1], got {depth}")
        target = min(int(round(depth * L)), L - 1)
        pool = [l for l in scored if l < L - 1] or scored
        return min(pool, key=lambda l: (abs(l - target), -l))
    if not 0 <= depth < L:
        raise ValueError(f"{what} {depth} is outside the model's layers 0..{L - 1}")
    if depth not in scored:
        raise ValueError(f"{what} {depth} is a sliding-window layer; choose one of the full-attention layers {scored}")
    return depth


@dataclass(frozen=True)
class Layout:
    """What the methods need to know of a model: its depth and which layers attend to every token
    (the others are sliding-window layers, never scored). A `ModelConfig` is one; build this for a
    model of your own."""

    num_layers: int
    full_attention_layers: list[int]


@dataclass
class Method:
    """Base: keep everything. Subclasses set the class attributes and override hooks.

    Fields shared by every compressing method:
        kv_budget: KV entries kept per layer, ratio of the prompt length or a token count.
        window: observation window w (last w prompt tokens, always kept).
        kernel, pooling: saliency pooling over tokens (FastKV: max-pool, kernel 7).
        per_head: per-KV-head selection (default) or one selection shared by all heads.
    """

    name = "full"
    compresses_kv = False  # per-layer KV selection
    min_window = 0  # methods scored by the observation window need at least one query
    # Whether the method has the structural budget R_struct (`struct_budget`: tokens that go on
    # past its propagation layer), for the harnesses that speak in R_KV / R_struct.
    has_struct_budget: ClassVar[bool] = False
    # The class of the propagation `propagation` returns, where it restarts the prefill (GemFilter):
    # `restarts(method)` reads the propagation's own `restart` flag through it, the one place that
    # fact is stated. None: a propagation that goes on, or none.
    propagation_kind: ClassVar[type | None] = None
    # Fields a run-wide setting (an eval's --window) never overrides: the method fixes them itself.
    fixed_options: ClassVar[tuple[str, ...]] = ()

    def validate(self) -> None:
        for name in BUDGETS:
            if getattr(self, name, None) is not None:
                check_budget(getattr(self, name), f"{self.name}: {name}")
        w = getattr(self, "window", 0)
        if isinstance(w, bool) or not isinstance(w, int) or w < self.min_window:
            raise ValueError(f"{self.name}: window must be an int >= {self.min_window}, got {w!r}"
                             + (" (its queries score the keys)" if self.min_window else ""))
        kernel = getattr(self, "kernel", 1)
        if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1:
            raise ValueError(f"{self.name}: kernel must be a positive int (pooling width in tokens), got {kernel!r}")
        for budget_name in BUDGETS:
            b = getattr(self, budget_name, None)
            if isinstance(b, int) and not isinstance(b, bool) and b < w:
                raise ValueError(f"{self.name}: {budget_name}={b} tokens is below the observation window ({w})")
        if getattr(self, "pooling", None) not in (None, "max", "avg"):
            raise ValueError(f"{self.name}: pooling must be 'max', 'avg' or None, got {self.pooling!r}")

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ planning
    def kv_keep(self, lengths) -> list[int]:
        """Entries kept per row in each compressed layer."""
        return self.fit_window(budget_tokens(self.kv_budget, lengths, f"{self.name} kv_budget"), lengths)

    def fit_window(self, keep: list[int], lengths) -> list[int]:
        """The rule for short prompts: a row always keeps its observation window (the whole prompt
        when it is shorter), so a ratio budget that floors below the window on a short prompt is
        raised to it. (A token-count budget below the window is refused by `validate`.)"""
        w = getattr(self, "window", 0)
        return [max(k, min(w, n)) for k, n in zip(keep, lengths.tolist())]

    def layer_keep(self, layer: int, layout, lengths, base: list[int]) -> list[int]:
        """Per-layer budget (PyramidKV overrides)."""
        return base

    # ------------------------------------------------------------------ hooks of the prefill loop
    def kv_plan(self, layout, lengths) -> dict[int, list[int]]:
        """Entries kept per row at each layer that selects its KV (the full-attention layers of a
        compressing method); layers not in the plan keep every entry (sliding layers: their ring)."""
        if not self.compresses_kv:
            return {}
        base = self.kv_keep(lengths)
        return {i: self.layer_keep(i, layout, lengths, base) for i in layout.full_attention_layers}

    def heads(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-KV-head scores (B, Hkv, n) as the selection wants them: per head, or summed into
        one shared selection (B, 1, n) when `per_head` is off."""
        return scores if self.per_head else scores.sum(1, keepdim=True)

    def kv_scores(self, view) -> torch.Tensor:
        """Scores (B, H, n) of the current tokens at a planned layer, higher = keep; H = Hkv (per
        KV head) or 1 (one selection for all heads)."""
        raise NotImplementedError(f"{self.name} plans KV selection but defines no kv_scores")

    def retention(self, plan: dict, cache):
        """How the planned layers' entries are chosen and stored (`structkv.modules.Retention`:
        at once, by `kv_scores`; StructKV may guide it by its pivot)."""
        from ..modules.retention import Retention

        return Retention(self, plan, cache)

    def propagation(self, layout, lengths):
        """A `structkv.modules.Propagation` for this prompt, or None (every token reaches the end)."""
        return None

    def plain(self) -> bool:
        """Whether the prefill is the model's own full pass: nothing to score, select or track."""
        return False

    def prefill_key(self) -> tuple:
        """Methods with equal keys compute the same hidden states to the last layer (they differ only
        in what each layer's cache keeps): one lane of `structkv.runtime.compress.compress_shared`. Methods
        that keep every token to the last layer share ("all",)."""
        return ("all",)

    def describe(self) -> dict:
        return {"method": self.name, **dataclasses.asdict(self)}


def restarts(method) -> bool:
    """Whether a method (or its class) re-encodes the tokens it keeps (GemFilter): its final cache
    then holds nothing it evicted, so it has no archive for ask-time recall."""
    kind = method.propagation_kind
    return kind is not None and kind.restart
