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
    {layer: keep per row} and the cache it fills."""

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


class ReconstructionRetention(Retention):
    """KVzip's retention: every planned layer's entries are held through the prefill, then scored
    by context reconstruction (`structkv.modules.reconstruction`) and selected at once. Extra
    memory during the prefill only (the final cache has the planned size); the reconstruction
    costs about one more prefill, reported as `reconstruction` (tokens run, seconds)."""

    def __init__(self, method, plan: dict, cache):
        super().__init__(method, plan, cache)
        self.held: list[_Held] = []
        self.reconstruction = None

    def layer(self, view) -> None:
        if view.layer in self.plan:
            self.held.append(_Held(view, None))
            return
        super().layer(view)

    def finish(self, model=None, tokens=None, memo: dict | None = None) -> None:
        if not self.held:
            return
        if model is None:
            raise ValueError("kvzip scores its entries by running the model again: the prefill loop passes it")
        m = self.method
        key = ("reconstruction", m.prompt, m.chunk, m.chat_turn, m.local, m.continued, m.sinks)
        memo = {} if memo is None else memo
        if key not in memo:  # the same context and K/V for every method of the lane: run it once
            memo[key] = self._score(model, tokens)
        scores, run, seconds = memo[key]
        if m.budget == "global":
            self._store_global(scores, getattr(model, "tp", None))
        else:
            for held in self.held:
                held.scores = self.method.heads(scores[held.layer])
                self._store(held)
        self.held = []
        self.reconstruction = {"tokens": run, "seconds": seconds}

    def _store_global(self, scores: dict, tp=None) -> None:
        """kvpress's allocation: one threshold per row over every held layer and KV head, so the
        layers' and heads' shares follow their scores; the total kept is the per-layer plan's. A
        layer whose heads now keep more than its plan gets a larger cache layer (same room). Under
        tensor parallelism the threshold is taken over every rank's heads (the same on all ranks)."""
        from ..models.kv_cache import LayerKVCache, round_capacity

        first = self.held[0]
        B, H = first.k.shape[:2]
        ranked = {}
        for held in self.held:  # the window always stays, as in every selection
            sc = scores[held.layer].clone()
            n = sc.shape[-1]
            sc[..., n - self.method.window:] = 3.0
            ranked[held.layer] = sc.masked_fill(~held.valid[:, None], float("-inf"))  # (B, Hkv, n)
        every = {i: tp.gather_heads(x) if tp is not None else x for i, x in ranked.items()}  # (B, all Hkv, n)
        for b in range(B):
            total = sum(self.plan[h.layer][b] for h in self.held) * every[first.layer].shape[1]
            pool = torch.cat([every[h.layer][b].flatten() for h in self.held])
            cut = pool.topk(min(total, pool.numel())).values[-1]
            for h in self.held:
                ranked[h.layer][b] = torch.where(ranked[h.layer][b] >= cut, ranked[h.layer][b], float("-inf"))
                every[h.layer][b] = torch.where(every[h.layer][b] >= cut, every[h.layer][b], float("-inf"))
        for held in self.held:
            keep = ranked[held.layer] > float("-inf")  # (B, Hkv, n)
            M = int((every[held.layer] > float("-inf")).sum(-1).max())  # over every rank's heads: one layout
            order = keep.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :M]
            idx = torch.where(keep.gather(2, order), order, torch.full_like(order, -1)).sort(-1).values  # -1 first
            old = self.cache.layers[held.layer]
            room = old.capacity - max(self.plan[held.layer])
            if M + room > old.capacity:
                self.cache.layers[held.layer] = LayerKVCache(B, H, round_capacity(M + room), old.head_dim, old.k.dtype,
                                                             old.pos.device, kv_dtype=old.kv_dtype)
            with held.timer.phase("cache_fill"):
                self.cache.fill(held.layer, held.k, held.v, held.positions, idx, check=False)

    def _score(self, model, tokens: torch.Tensor):
        """Scores (B, Hkv, n) per held layer, one row at a time (each row's own context, unpadded)."""
        from .reconstruction import reconstruction_scores

        prompt_ids, head = _reconstruction_prompt(model.tokenizer, self.method)
        first = self.held[0]
        out = {h.layer: torch.zeros(h.k.shape[:3], device=h.k.device) for h in self.held}  # (B, Hkv, n)
        run = seconds = 0
        room = max(len(prompt_ids(i, [0] * self.method.chunk)) for i in (0, 1)) + self.method.chunk
        for b in range(first.valid.shape[0]):
            cols = first.valid[b].nonzero()[:, 0]  # this row's tokens (no propagation: the same at every layer)
            held = {h.layer: (h.k[b:b + 1, :, cols], h.v[b:b + 1, :, cols], h.positions[b:b + 1, cols])
                    for h in self.held}
            row = tokens[b, first.columns[b, cols]]
            rings = {i: _row(layer, b, room) for i, layer in enumerate(self.cache.layers) if i not in held}
            start_at = len(head) if head and row[:len(head)].tolist() == head else 0  # the head: not repeated
            scores, r, s = reconstruction_scores(model, held, rings, row, prompt_ids, self.method.chunk,
                                                 local=self.method.local, start_at=start_at)
            for i, sc in scores.items():
                sc[..., :self.method.sinks] = 2.0  # above any probability: the first tokens always stay
                out[i][b:b + 1, :, cols] = sc
            run, seconds = run + r, seconds + s
        return out, run, seconds


def _row(layer, b: int, room: int):
    """A one-row copy of a cache layer with `room` free slots after its entries (a ring stays its
    window): the reconstruction writes a chunk into it, then restores it."""
    from ..models.kv_cache import LayerKVCache

    used = layer.capacity if layer.window is not None else int(layer.cursor)
    out = LayerKVCache(1, layer.k.shape[1], used + room, layer.head_dim, layer.k.dtype, layer.k.device,
                       window=layer.window, kv_dtype=layer.kv_dtype)
    for name in (*layer.planes, "pos"):
        getattr(out, name)[:, :, :used] = getattr(layer, name)[b:b + 1, :, :used]
    out.cursor.copy_(layer.cursor)
    return out


def _reconstruction_prompt(tokenizer, method):
    """(chunk number, previous chunk's ids) -> the ids before a chunk, and the chat template's head
    ids (what a context inside a user turn starts with; [] when the prompt is not a chat turn).

    `chat_turn`: the prompt closes the user turn and opens the assistant's (the template's tail)
    before the repeated chunk, so the repetition is the assistant's answer, as kvpress does for
    models with a template; `continued`: chunks after the first are asked to repeat "starting
    with" the previous chunk's last tokens (kvpress's prompt)."""
    from ..text import chat
    from .reconstruction import CONTINUE_TOKENS, KVPRESS_CONTINUE

    if tokenizer is None:
        return (lambda i, prev: []), []
    base = tokenizer.encode(method.prompt, add_bos=False)
    head, tail = [], []
    if method.chat_turn and getattr(tokenizer, "chat_template", None):
        head, tail = chat.frame(tokenizer)
    again = tokenizer.encode(KVPRESS_CONTINUE, add_bos=False) if method.continued else base

    def prompt(i: int, previous: list[int]) -> list[int]:
        if i == 0 or not method.continued:
            return base + tail
        return again + previous[-CONTINUE_TOKENS:] + tail
    return prompt, head
