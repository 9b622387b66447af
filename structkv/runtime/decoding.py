"""The decode loop: one token per row through a cache, for one row or many.

Every generation ends here: `generate` (one prompt or a batch), `generate_states` (many
compressed states stacked) and the server's continuous batch (`structkv.serve.batcher`, rows
joining and leaving between steps). `Decoding` holds what a step needs (the cache, each row's
next-token logits and next position) and `feed` is the step; `decode_tokens` is the loop for rows
that start and sample together, the batcher drives `feed` itself because its rows sample with
their own settings and come and go.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.kv_cache import LayerKVCache
from ..util.compiling import compiled_per_model, should_compile_decode

STOP_CHECK_EVERY = 8  # decode steps between host checks of "every row has stopped"


def decode_step(model, tokens, positions, cache):
    """One token per row (R, 1) at `positions` (R, 1) into `cache`; the next logits (R, V)."""
    return model.decode_step(tokens, positions, cache)


# Inductor's options for the decode graphs. No size asserts: the generated step checked every
# input's sizes and strides on every call (1,057 Python calls a step for SmolLM2, ~1 us each,
# measured), facts `structure_key` (the model's weights) and dynamo's guards (the cache) already hold.
DECODE_INDUCTOR = {"size_asserts": False}
# On CUDA the static decode graph is also replayed as a CUDA graph (inductor's "triton.cudagraphs",
# what mode="reduce-overhead" turns on): a step's hundreds of kernel launches become one replay.
# The step reads nothing back to the host and writes the cache in place (module buffers, static
# to the graph), as CUDA graphs need (tests/test_cuda_trace.py). Never run on the CPU reference
# machine; `benchmarks/gpu_check.sh` runs it where a GPU is lent.
DECODE_INDUCTOR_CUDA = {**DECODE_INDUCTOR, "triton.cudagraphs": True}


def decode_inductor(device) -> dict:
    """Inductor options of the static decode graph on `device`."""
    return DECODE_INDUCTOR_CUDA if device is not None and torch.device(device).type == "cuda" else DECODE_INDUCTOR


def compiled_decode(backend="inductor", inductor: dict = DECODE_INDUCTOR):
    """The decode step, compiled once per model structure and cache shape (without dynamo's
    per-step checks of every module and weight: `structkv.util.compiling.compiled_per_model`)."""
    return compiled_per_model(decode_step, backend, inductor, fullgraph=True, dynamic=False)


# What changes as rows join and leave a running batch: the row count (dim 0) of the tokens, the
# positions and every cache buffer, and the capacity (dim 2) of the cache's planes and positions.
# Module buffers are static to dynamo unless a source names them (`torch.compiler.config.dynamic_sources`).
_LAYER_BUFFER = r"L\['cache'\]\._modules\['layers'\]\._modules\['\d+'\]\._buffers\['"
ROWS_AND_CAPACITY = ",".join([r"L\['tokens'\]:0", r"L\['positions'\]:0", _LAYER_BUFFER + r"\w+'\]:0",
                              _LAYER_BUFFER + "(" + "|".join(LayerKVCache.capacity_buffers()) + r")'\]:2"])


def batch_step(model, tokens, positions, cache):
    """`decode_step` under its own code object, so the batch's symbolic graphs have a cache of their own."""
    return model.decode_step(tokens, positions, cache)


def compiled_batch_decode(backend="inductor"):
    """The decode step of a batch whose rows come and go (serve's), compiled with the row count
    and the cache's capacity symbolic: one graph per row class (1 row; 2 up to
    `structkv.models.linear.SKINNY_ROWS`; more) serves every later membership and length, where a
    static graph per (rows, capacity) recompiled at every join and leave (research/benchmarks_log.md).
    The sources are named only while this step runs (set and restored around each call): other
    compiled functions keep their static shapes."""
    step = compiled_per_model(batch_step, backend, DECODE_INDUCTOR, fullgraph=True, dynamic=False)

    def call(model, tokens, positions, cache):
        before = torch.compiler.config.dynamic_sources
        torch.compiler.config.dynamic_sources = ROWS_AND_CAPACITY
        try:
            return step(model, tokens, positions, cache)
        finally:
            torch.compiler.config.dynamic_sources = before

    return call


def step_function(backend=None, rows_vary: bool = False, device=None):
    """The decode step for `backend` (a torch.compile backend, or None: eager); `rows_vary`: rows
    join and leave between steps (`compiled_batch_decode`, no CUDA graphs: its shapes vary);
    `device`: the model's (a static graph on CUDA replays as a CUDA graph)."""
    if not backend:
        return decode_step
    return compiled_batch_decode(backend) if rows_vary else compiled_decode(backend, decode_inductor(device))


def backends(model, compile, max_new_tokens) -> tuple:
    """(prefill backend, decode backend) for `generate`'s `compile` argument; None = eager.
    "auto" runs the prefill eager and compiles the decode step only when it pays
    (`structkv.util.compiling`)."""
    if compile == "auto":
        return None, ("inductor" if should_compile_decode(model, max_new_tokens) else None)
    backend = "inductor" if compile is True else (compile or None)
    return backend, backend


def eos_ids(model) -> tuple[int, ...]:
    """The token ids that end a generation: the config's, else the tokenizer's."""
    return tuple(model.config.eos_token_ids or (model.tokenizer.eos_ids if model.tokenizer is not None else ()))


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
           generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from logits (B, V): greedy at temperature 0, else top-k / nucleus sampling.

    Temperatures too small for float32 (below its smallest normal number, where 1 / t overflows)
    sample their limit, the argmax. Above that, logits are shifted by their maximum before the
    division, so the largest is 0 and the rest finite or -inf: never inf - inf, never NaN, and one
    row's tiny temperature cannot make `multinomial` fail the rows sampled beside it."""
    if temperature < torch.finfo(torch.float32).tiny:
        return logits.argmax(-1)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Decoding:
    """Rows decoding together: the cache they write into, each row's next-token logits (R, V)
    and next position (R, 1). `feed(tokens)` is one decode step for all of them."""

    model: object
    cache: object
    logits: torch.Tensor | None
    positions: torch.Tensor
    step: object = decode_step  # `step_function(backend)`
    bound: object = None  # a `structkv.modules.decode_bound.BoundedDecode` on `cache`, or None

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (R,) at the rows' next positions; the next logits (R, V).
        With a `bound`, rows about to pass it evict first."""
        if self.bound is not None:
            self.bound.before_step()
        self.logits = self.step(self.model, tokens[:, None], self.positions, self.cache)
        self.positions = self.positions + 1
        if self.bound is not None:
            self.bound.after_step()
        return self.logits


def bounded(model, cache, max_kv_tokens):
    """A `BoundedDecode` on `cache` for `generate`'s `max_kv_tokens` (an int or a `DecodeBound`, for
    every row) or a list of them (one per row, None: unbounded), or None without any bound. Under
    tensor parallelism its sums over heads go over the ranks."""
    from ..modules.decode_bound import BoundedDecode, DecodeBound

    rows = cache.layers[0].pos.shape[0]
    bounds = [DecodeBound.of(b) for b in max_kv_tokens] if isinstance(max_kv_tokens, list) \
        else [DecodeBound.of(max_kv_tokens)] * rows
    if all(b is None for b in bounds):
        return None
    group = model.config.num_heads // model.config.num_kv_heads  # query heads per KV head
    tp = getattr(model, "tp", None)
    return BoundedDecode(bounds, cache, group, tp.all_reduce if tp else None)


def decode_tokens(rows: Decoding, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, stop_at_eos: bool = True, generator=None,
                  stream=None) -> tuple[list[list[int]], int]:
    """Sample, feed, repeat: new token ids per row (cut at the first EOS) and the steps taken.

    Sampling and the stop test stay on the device; the host asks whether every row has stopped
    only every `STOP_CHECK_EVERY` steps (a few steps may run past the last EOS and are cut), or
    at every step when `stream` needs each token as it comes (`stream(tokens)` gets each row's new
    id, None for a row that has stopped; returning True stops). The steps reported end at the
    step where the last row stopped, as if checked every step.
    """
    model = rows.model
    B = rows.logits.shape[0]
    eos = torch.tensor(eos_ids(model), dtype=torch.long, device=model.device)
    stops = stop_at_eos and eos.numel() > 0
    done = torch.zeros(B, dtype=torch.bool, device=model.device)
    out = []
    for step in range(max_new_tokens):
        tok = sample(rows.logits, temperature, top_k, top_p, generator)  # (B,)
        out.append(tok)
        was_done = done.clone() if stream is not None else None
        if stops:
            done |= torch.isin(tok, eos)
        if stream is not None and stream([None if d else t for t, d in zip(tok.tolist(), (was_done | done).tolist())]):
            break  # the caller asked to stop (a stop string appeared, its client went away)
        checked = stream is not None or (step + 1) % STOP_CHECK_EVERY == 0
        if stops and checked and bool(done.all()):
            break
        if step == max_new_tokens - 1:
            break
        rows.feed(tok)
    ids = torch.stack(out, 1).tolist()  # (B, steps)
    if not stops:
        return ids, len(out)
    ends = set(eos.tolist())
    cuts = [next((j for j, t in enumerate(row) if t in ends), None) for row in ids]
    steps = len(out) if None in cuts else max(cuts) + 1  # where the last row stopped
    return [row if cut is None else row[:cut] for row, cut in zip(ids, cuts)], steps
