"""KV retention: when and by which scores each planned layer's cache entries are chosen.

`Retention` is what every method had so far: at a planned layer, rank the tokens by the method's
`kv_scores`, keep the window plus the best, store them; nothing waits.

`GuidedRetention` is StructKV's cross-layer retention: a layer's entries are chosen by
    norm(S^(l)) + beta * norm(G),
S^(l) the layer's own scores, G a guide on the original prompt columns that the propagation
produces at the pivot (the pivot layer's pooled saliency per KV head, or the centrality C), and
norm(x) = x / sum(x) over the row's ranked columns (each vector sums to 1, so beta weighs like
for like). Layers before the pivot cannot know G yet: their K/V stay whole until the pivot
fires, then all are selected at once (extra memory during the prefill only; the final cache is
the same size). Why: per-layer selection is local, and early layers drop tokens the retrieval
layers rank highly (the needle ranked 1209-1661 at Gemma 3's layer 5 but <= 340 at layer 11).
"""
from __future__ import annotations

import torch

from .scores import ranked_columns, share_of
from .selection import select_tokens


class Retention:
    """Select and store each planned layer's entries at once. Args: the method, its plan
    {layer: keep per row} and the cache it fills. `extra_pass`: a retention that runs the model
    over the prompt again to score it (KVzip, `structkv.methods.kvzip`) reports that pass here
    ({"tokens", "seconds"}): the prefill counts it as its own work."""

    extra_pass: dict | None = None
    needs_model = False  # True: `finish` runs the model over the prompt again (KVzip)

    def __init__(self, method, plan: dict, cache):
        self.method, self.plan, self.cache = method, plan, cache

    def layer(self, view) -> None:
        """Store layer `view.layer`'s entries (the window plus the best, or every entry if unplanned)."""
        if view.layer not in self.plan:
            with view.timer.phase("cache_fill"):
                self.cache.fill(view.layer, view.k, view.v, view.positions, None, check=False)
            return
        self._store(_Held(view, self.method.kv_scores(view)))

    def after_propagation(self, prop) -> None:
        """Called after the propagation saw the layer (a guide may now exist)."""

    def finish(self, model=None, tokens=None, memo: dict | None = None) -> None:
        """Called once after the last layer, with the model and the prompt's token ids (B, S);
        `memo`: shared by the methods of one lane (same tokens at every layer), for work that
        depends only on them (KVzip's reconstruction)."""

    def _scores(self, held: "_Held") -> torch.Tensor:
        """The scores (B, H, n), H = Hkv or 1, that choose a planned layer's entries."""
        return held.scores

    def _store(self, held: "_Held") -> None:
        idx = select_tokens(self._scores(held), held.valid, self.plan[held.layer], self.method.window, held.lengths)
        idx = idx.expand(-1, held.k.shape[1], -1) if idx.shape[1] == 1 else idx[:, held.kv_heads]  # (B, Hkv, K)
        with held.timer.phase("cache_fill"):
            self.cache.fill(held.layer, held.k, held.v, held.positions, idx, check=False)


class _Held:
    """A planned layer's K/V, positions, columns and own scores (held until the guide exists)."""

    def __init__(self, view, scores):
        self.layer, self.k, self.v, self.positions = view.layer, view.k, view.v, view.positions
        self.columns, self.scores, self.valid, self.timer = view.columns, scores, view.valid, view.timer
        self.lengths = view.lengths
        self.kv_heads = view.kv_heads  # this rank's heads among the scores' (tensor parallelism)


class GuidedRetention(Retention):
    """`Retention` blended with the propagation's guide (see the module docstring).

    Args: beta, the guide's weight (0 = the plain method: same entries as `Retention`).
    The propagation must offer `guide()` -> (B, Hg, N) on prompt columns, or None until every row
    has fired."""

    def __init__(self, method, plan: dict, cache, beta: float):
        super().__init__(method, plan, cache)
        self.beta, self.guide, self.held = beta, None, []

    def layer(self, view) -> None:
        if view.layer in self.plan and self.guide is None and self.beta:
            self.held.append(_Held(view, self.method.kv_scores(view)))  # chosen once the guide exists
            return
        super().layer(view)

    def after_propagation(self, prop) -> None:
        if self.guide is None and self.beta and prop is not None:
            self.guide = prop.guide()
            if self.guide is not None:
                self._flush()

    def finish(self, model=None, tokens=None, memo: dict | None = None) -> None:
        self._flush()  # never guided (no pivot fired): own scores only

    def _flush(self) -> None:
        for held in self.held:
            self._store(held)
        self.held = []

    def _scores(self, held: _Held) -> torch.Tensor:
        if self.guide is None:
            return held.scores
        ranked = ranked_columns(held.valid, self.method.window)  # (B, n)
        g = self.guide.gather(2, held.columns[:, None].expand(-1, self.guide.shape[1], -1))  # (B, Hg, n)
        return share_of(held.scores, ranked) + self.beta * share_of(g, ranked)
