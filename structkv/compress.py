"""compress: the prefill loop of every method, one layer at a time.

Per layer: run the block on the current tokens; if the method's plan selects this layer's KV,
rank the tokens by `method.kv_scores` and keep the window plus the best (`select_tokens`); store
the layer's entries in the cache; let the method's propagation decide whether only some tokens
go on. Deeper layers then compute on fewer tokens: the prefill saving, reported as the fraction
of token-layers computed. GemFilter's propagation restarts instead: the whole model re-encodes
its selected tokens with renumbered positions.

Every token carries its original position (left padding = -1), so a kept subset attends exactly
as it would in the full prompt. Hybrid models (Gemma 3): only full-attention layers are planned or
scored; sliding layers keep their window as a ring (after a propagation: the skeleton's tokens
in it). `structkv.shared.compress_shared` runs many methods in one pass with the same per-layer
pieces (`Stream`, `LayerView`, `Retention`).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .methods import Full, Method
from .models.decoder import run_block
from .models.kv_cache import BudgetedKVCache
from .modules import LayerView
from .prompts import encode_batch, is_batch
from .stats import PrefillStats
from .timing import NO_TIMER, Timer, clock


@dataclass
class CompressedState:
    """A prompt compressed once: the cache, the last logits and where positions continue."""

    cache: BudgetedKVCache
    logits: torch.Tensor  # (B, V) float32, next-token logits after the prompt
    next_positions: torch.Tensor  # (B, 1) position of the next token per row
    lengths: list[int]  # prompt tokens per row
    method: Method
    stats: PrefillStats | None = None
    kept_columns: torch.Tensor | None = None  # (B, K) prompt columns that reached the last layer, -1 = pad
    source: object = None  # weakref to the model that made it: a state only makes sense on that model
    messages: list | None = None  # the chat messages it holds, when made from messages

    def check_model(self, model) -> None:
        """Refuse to extend this state with a model other than the one that made it."""
        if self.source is not None and self.source() is not model:
            raise ValueError("this compressed state was made by another model; call structkv.prefill(model, context, "
                             "method) with the model you generate with")


@dataclass
class Stream:
    """The tokens still computed: hidden states (B, n, E), original positions and prompt columns
    (B, n), and their RoPE tables."""

    h: torch.Tensor
    positions: torch.Tensor
    columns: torch.Tensor
    rope: dict
    tp: object = None  # the model's TensorParallel group, if it is one rank's shard

    @classmethod
    def start(cls, model, tokens: torch.Tensor, positions: torch.Tensor) -> "Stream":
        B, S = tokens.shape
        pos = positions.clone()  # an inference tensor like every later one: no recompile after propagation
        cols = torch.arange(S, device=tokens.device).expand(B, S)
        return cls(model.embed(tokens), pos, cols, model.rope_tables(pos), getattr(model, "tp", None))

    def run_layer(self, model, i: int, block) -> tuple:
        """Layer `i` on the current tokens (in place); returns its (q, k, v)."""
        cos, sin = self.rope[model.config.layer_types[i]]
        self.h, q, k, v = block(model.model.layers[i], self.h, self.positions, cos, sin)
        return q, k, v

    def view(self, i: int, qkv: tuple, scale: float, timer: Timer) -> LayerView:
        return LayerView(i, *qkv, self.positions, self.columns, scale, timer=timer, tp=self.tp)

    def kept_columns(self) -> torch.Tensor:
        """(B, n) prompt columns of the current tokens, -1 on padding."""
        return torch.where(self.positions >= 0, self.columns, torch.full_like(self.columns, -1))

    def gather(self, model, pruner, indices: torch.Tensor) -> "Stream":
        """The kept tokens (B, K) as a new stream, original positions kept."""
        h, cols, pos = pruner.gather(indices, self.h, self.columns, positions=self.positions)
        return Stream(h, pos, cols, model.rope_tables(pos), self.tp)


def plan_method(model, method: Method, lengths, num_tokens: int, room: int):
    """The method's per-layer KV plan, its propagation and the `Retention` that fills its cache
    (None when the propagation restarts: the restart makes the cache)."""
    cfg = model.config
    plan, prop = method.kv_plan(cfg, lengths), method.propagation(cfg, lengths)
    budgets = [max(plan[i]) if i in plan else num_tokens for i in range(cfg.num_layers)]
    cache = None if prop is not None and prop.restart else BudgetedKVCache.for_model(
        cfg, len(lengths), budgets, room, model.dtype, model.device)
    return plan, prop, None if cache is None else method.retention(plan, cache)


def check_scorable(cfg) -> None:
    if not cfg.full_attention_layers:
        raise ValueError("the model has no full-attention layer to score; compression needs one")


@torch.inference_mode()
def compress(model, tokens: torch.Tensor, positions: torch.Tensor, method: Method | None = None,
             room: int = 256, compile=False, timer: Timer = NO_TIMER) -> CompressedState:
    """Prefill `tokens` (B, S) at `positions` (B, S) (-1 = left padding) with `method`.

    `room`: cache slots after the kept entries for tokens appended later (generation, questions).
    `compile`: False (eager), True (inductor) or a backend: each layer block runs compiled with a
    dynamic length. `timer`: a `structkv.timing.Timer` to fill the phase times of the stats.
    """
    method, cfg, S = method or Full(), model.config, tokens.shape[1]
    check_scorable(cfg)
    t0, lengths = clock(), (positions >= 0).sum(1)
    plan, prop, store = plan_method(model, method, lengths, S, room)
    if prop is not None:
        prop.begin(S, tokens.device)
    stream, block, processed = Stream.start(model, tokens, positions), layer_block(compile, cfg), []
    for i in range(cfg.num_layers):
        with timer.phase("blocks"):
            view = stream.view(i, stream.run_layer(model, i, block), cfg.scale, timer)
        processed.append(int(view.valid.sum()))
        if store is not None:
            with timer.phase("selection"):
                store.layer(view)
        kept = None
        if prop is not None:
            with timer.phase("propagation"):
                kept = prop.after_layer(view)
        if kept is not None and prop.restart:
            return restart(model, tokens, stream, kept, method, prop, processed, lengths, room, compile, t0, timer)
        if store is not None:
            store.after_propagation(prop)
        if kept is not None:
            stream = stream.gather(model, prop.pruner, kept)
    store.finish()  # (a restart returned above: every other method has a store)
    cache = store.cache
    logits = model.logits(stream.h[:, -1])
    next_positions = stream.positions.max(dim=1, keepdim=True).values + 1  # (B, 1)
    kept_columns = stream.kept_columns()
    stats = prefill_stats(model, method, lengths, processed, cache, prop, clock() - t0, timer)
    return CompressedState(cache, logits, next_positions, lengths.tolist(), method, stats, kept_columns,
                           weakref.ref(model))


def prefill(model, context=None, method: Method | None = None, *, messages=None, room: int = 256,
            compile=False) -> CompressedState:
    """Compress once, ask many: prefill `context` (text, ids or a batch) with `method` and return
    a reusable `CompressedState`; pass it to `structkv.generate(model, question, state=...)`.
    `messages` instead of `context`: a conversation rendered by the model's chat template (e.g. a
    user turn holding a long document); later turns go to `generate(messages=..., state=...)`."""
    if isinstance(method, str):
        from .methods import get

        method = get(method)
    if (context is None) == (messages is None):
        raise ValueError("give the context either as `context` (text or ids) or as chat `messages`")
    if messages is not None:
        from .chat import encode as encode_chat

        context = encode_chat(_tokenizer(model), messages, add_generation_prompt=False)
    tokens, positions, _ = encode_batch(model, context if is_batch(context) else [context])
    state = compress(model, tokens, positions, method, room=room, compile=compile)
    state.messages = list(messages) if messages is not None else None
    return state


def _tokenizer(model):
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: chat messages need one (tokenizer.json in its folder)")
    return model.tokenizer


def restart(model, tokens, stream: Stream, kept, method, prop, processed, lengths, room, compile, t0, timer):
    """GemFilter: the kept tokens, renumbered 0..K-1, re-encoded by the whole model (uncompressed)."""
    new_cols, new_pos = prop.pruner.gather(kept, stream.columns, positions=stream.positions)  # compact positions
    new_tokens = torch.where(kept >= 0, tokens.gather(1, new_cols), torch.zeros_like(new_cols))
    rerun = compress(model, new_tokens, new_pos, Full(), room, compile)
    kept_columns = torch.where(kept >= 0, new_cols, torch.full_like(kept, -1))
    stats = prefill_stats(model, method, lengths, processed + rerun.stats.tokens_per_layer, rerun.cache, prop,
                          clock() - t0, timer)
    return CompressedState(rerun.cache, rerun.logits, rerun.next_positions, lengths.tolist(), method, stats,
                           kept_columns, weakref.ref(model))


def prefill_stats(model, method, lengths, processed, cache, prop, prefill_s: float, timer: Timer) -> PrefillStats:
    cfg = model.config
    pivots = prop.pivots if prop is not None else [None] * len(lengths)
    kept = cache.nbytes()
    totals = timer.totals if timer.enabled else None
    return PrefillStats(
        method=method.name, prompt_tokens=lengths.tolist(), tokens_per_layer=processed,
        prefill_fraction=sum(processed) / (cfg.num_layers * int(lengths.sum())),
        pivot_layer=pivots if len(pivots) > 1 else pivots[0], kv_entries_per_layer=cache.entries(),
        kv_bytes_per_layer=kept, kv_bytes_allocated_per_layer=cache.nbytes(used=False),
        kv_bytes_full_layers=sum(kept[i] for i in cfg.full_attention_layers), prefill_s=prefill_s,
        host_syncs=prop.host_syncs if prop is not None else 0,
        scoring_s=totals["scoring"] if totals else None,
        selection_s=totals["selection"] + totals["propagation"] if totals else None,
        cache_fill_s=totals["cache_fill"] if totals else None,
        **_tp_stats(model, kept), **(prop.stats() if prop is not None else {}))


def _tp_stats(model, kept: list[int]) -> dict:
    """Under tensor parallelism: the ranks and the kept bytes of all of them (one all-reduce)."""
    tp = getattr(model, "tp", None)
    if tp is None:
        return {}
    total = tp.all_reduce(torch.tensor([sum(kept)], dtype=torch.float64, device=model.device))
    return {"tp_ranks": tp.world, "kv_bytes_all_ranks": int(total.item())}


def layer_block(compile, cfg):
    """`run_block`, or its compiled form with the token dimension marked dynamic, so one graph per
    layer kind serves every length, before and after propagation."""
    if not compile:
        return run_block
    from .compiling import compiled

    fn = compiled(run_block, "inductor" if compile is True else compile, fullgraph=True)

    def block(layer, h, positions, cos, sin):
        for x, dim in ((h, 1), (positions, 1), (cos, 2), (sin, 2)):
            torch._dynamo.mark_dynamic(x, dim, min=2, max=cfg.max_position_embeddings)
        return fn(layer, h, positions, cos, sin)

    return block
