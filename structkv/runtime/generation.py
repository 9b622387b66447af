"""Generation with a static, preallocated KV cache.

The decode step is compiled once per cache shape with `fullgraph=True` (the cache capacity is
rounded up to a multiple of `kv_cache.CAPACITY_MULTIPLE`, so calls with similar lengths share it); the
prefill is compiled with a dynamic prompt length, so one compile serves every prompt length.
`compile=False` runs eager; the default "auto" compiles only what pays for the call
(`structkv.util.compiling`). Prompts of a batch are left-padded: padding has position -1, so it
is never a visible key and every row gets exactly what it would get alone. The decode loop itself
(the step, sampling, stopping) is `structkv.runtime.decoding`, shared with the server's batch.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

import torch

from ..methods.full import Full
from ..models.kv_cache import StackedKVCache, StaticKVCache, round_capacity
from ..modules.decode_bound import DecodeBound
from ..text.detokenize import StopText
from ..text.prompts import PROMPT_TYPES, encode_batch, ids_from_prompt, is_batch
from ..util.compiling import compiled, mark_warm
from ..util.timing import NO_TIMER, Timer, sync
from .decoding import Decoding, backends, bounded, decode_tokens, step_function
from .stats import PrefillStats


@dataclass
class GenerationResult:
    """The new text and token ids (lists for a batch), `prefill`: the typed stats of the
    compressed prefill (of the context, when generating from a state; None for `full`), and
    `stats`: one flat, read-only record of the call for tables and logs: the prefill's fields (a
    state's, from a state: its method, prefill fraction, pivot), then this call's own prompt,
    prefill and decode figures, which win where names meet. `prefill_s` is always the prompt's
    compression (from a state: the context's, when it was compressed); from a state the question's
    extension has its own name, `question_s`."""

    text: str | list[str]
    token_ids: list[int] | list[list[int]]
    stats: dict = field(default_factory=dict)
    prefill: PrefillStats | None = None


def _prefill(model, tokens, positions):
    return model.prompt_pass(tokens, positions)


def compiled_prefill(backend="inductor"):
    """The uncompressed prompt pass, compiled with a dynamic prompt length."""
    return compiled(_prefill, backend, fullgraph=True)


def _check_sampling(max_new_tokens, temperature, top_k, top_p):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def _method(method):
    """A Method, a registered name (with its default options), or None."""
    from ..methods import Method, get

    if method is None or isinstance(method, Method):
        return method
    if isinstance(method, str):
        return get(method)
    raise TypeError(f"method must be a structkv method (structkv.methods.get(name, ...)) or a registered name, "
                    f"got {type(method).__name__}")


@torch.inference_mode()
def generate(model, prompt=None, *, messages=None, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop_at_eos: bool = True, compile="auto",
             seed: int | None = None, method=None, state=None, stream=None, timing: bool = False,
             recall=None, max_kv_tokens=None) -> GenerationResult:
    """Generate a continuation of `prompt` (text, token ids, or a list of either for a batch).

    `messages` instead of `prompt`: a conversation ([{"role": "user", "content": ...}, ...])
    rendered by the model's chat template with the assistant's turn opened; generation stops at
    the template's end-of-turn token. With a `state` made from messages, `messages` is the whole
    conversation so far and only what follows the state's messages is appended (uncompressed).

    `method`: a compression method (`structkv.methods.get(...)`); None or `full` keeps every entry.
    `state`: a `CompressedState` from `structkv.prefill(model, context, method)`; `prompt` is then a question
    appended to the compressed context (not compressed itself), on a copy of the cache.
    `compile`: True (inductor), False (eager), "auto" (compile only where it pays for this call,
    `structkv.util.compiling`) or a torch.compile backend.
    `stream`: called after every step with each row's new token id (None for a row that has
    stopped), so text can be shown as it is produced; returning True stops generation there.
    `timing`: time the compression's phases (scoring, selection, cache fill; synchronises a GPU at
    each phase). `recall`: with a `state` that has an archive (`structkv.prefill(..., archive=...)`),
    the entries each archived layer recalls for this question (a ratio of the context or a count;
    None: the state's own default, 0: none; `structkv.modules.recall`). `max_kv_tokens`: bound
    every layer's entries while generating (an int, or a `structkv.modules.DecodeBound` with its
    eviction rule; `structkv.modules.decode_bound`), so a long answer does not grow the cache without
    limit; None: no bound. Returns the new text, the new token ids and stats; a list prompt gives lists.
    """
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    method = _method(method)
    bound = DecodeBound.of(max_kv_tokens)
    if messages is not None:
        prompt = _chat_prompt(model, prompt, messages, state)
    elif prompt is None:
        raise TypeError(f"a prompt must be {PROMPT_TYPES}, got NoneType (or give chat messages=[...])")
    if isinstance(prompt, (list, tuple)) and len(prompt) == 0:
        raise ValueError("prompt is empty: give text, token ids or a non-empty list of prompts")
    backend, decode_backend = backends(model, compile, max_new_tokens)
    t0 = time.perf_counter()
    run = start(model, prompt, max_new_tokens=max_new_tokens, method=method, state=state, backend=backend,
                decode_backend=decode_backend, timing=timing, recall=recall, bound=bound)
    sync(model.device)
    t1 = time.perf_counter()
    cache, stats, B = run.cache, run.stats, run.logits.shape[0]
    generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    step = step_function(decode_backend, device=model.device)
    rows = Decoding(model, cache, run.logits, run.next_pos, step, bounded(model, cache, bound))
    ids, steps = decode_tokens(rows, max_new_tokens, temperature, top_k, top_p, stop_at_eos, generator, stream)
    cache = rows.cache
    sync(model.device)
    t2 = time.perf_counter()
    texts = [model.tokenizer.decode(r) for r in ids] if model.tokenizer is not None else [None] * B
    stats.update({
        "prompt_tokens": run.lengths if run.batched else run.lengths[0],
        "new_tokens": steps,
        **({"prefill_s": t1 - t0} if state is None else {"question_s": t1 - t0}),
        "decode_s": t2 - t1,
        "decode_tokens_per_s": (steps - 1) * B / (t2 - t1) if steps > 1 and t2 > t1 else float("nan"),
        "kv_cache_bytes": sum(layer.nbytes() for layer in cache.layers),  # allocated, room included
        "kv_bytes_kept": run.kept,
        "kv_entries": sum(cache.entries()),
        "compiled_parts": [part for part, b in (("prefill", backend), ("decode", decode_backend)) if b],
        **(rows.bound.stats() if rows.bound is not None else {}),
    })
    if decode_backend == "inductor":
        mark_warm(model, "decode")
    if run.batched:
        return GenerationResult(texts, ids, stats, run.prefill)
    return GenerationResult(texts[0], ids[0], stats, run.prefill)


@dataclass
class Started:
    """A generation after its prompt pass, before its first new token: the cache (with room for the
    new tokens), the last logits (B, V), the next position of every row (B, 1), the tokens per row
    so far, the call's stats so far, the compression's typed stats (None for `full`), and the bytes
    the compression kept of the prompt (of the context, from a state) before anything is appended.
    `generate` decodes it alone; `structkv serve` decodes many together (`structkv.serve.batcher`)."""

    cache: object
    logits: torch.Tensor
    next_pos: torch.Tensor
    lengths: list[int]
    stats: dict
    prefill: PrefillStats | None
    kept: int
    batched: bool


def start(model, prompt, *, max_new_tokens: int, method=None, state=None, backend=None, decode_backend=None,
          timing: bool = False, recall=None, bound=None, block=None) -> Started:
    """The prompt pass of `generate` (see there): compress `prompt` with `method`, run it whole, or
    append it to a copy of `state`'s compressed context (recalling from its archive, `recall`);
    `backend` / `decode_backend`: compile the prefill / a one-token prompt's step (None: eager);
    `bound`: a `DecodeBound` the decode will keep (the cache then needs room for the bound, not for
    every new token); `block`: how the prompt's layers run (see `structkv.compress`; a question on a
    state is appended through the cache as always)."""
    limit = model.config.max_position_embeddings
    room = max_new_tokens if bound is None else min(max_new_tokens, bound.max_tokens + 1)
    stats: dict = {}
    prefill = None
    if state is None and recall is not None:
        raise ValueError("recall= reads a compressed state's archive: pass state=structkv.prefill(model, context, "
                         "method, archive='int4')")
    if state is not None:
        if method is not None:
            raise ValueError("pass either method= (compress this prompt) or state= (reuse a compressed context)")
        prefill = state.stats
        stats.update(state.stats.items())
        cache, logits, next_pos, lengths = _extend_state(model, state, prompt, max_new_tokens, recall, stats,
                                                         decode_bound=bound is not None)
        batched = logits.shape[0] > 1
    else:
        batched = is_batch(prompt)
        tokens, positions, lengths = encode_batch(model, prompt if batched else [prompt])
        if max(lengths) + max_new_tokens - 1 > limit:  # the last new token is never fed back
            raise ValueError(
                f"prompt of {max(lengths)} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"{limit} positions; shorten the prompt or ask for fewer tokens"
            )
        if (method is None or method.plain()) and bound is not None and bound.ranker.carries:
            method = Full(centrality=True)  # the full cache, with the centrality the rule starts from
        if method is not None and not method.plain():
            from .compress import compress

            compressed = compress(model, tokens, positions, method, room=room, compile=backend or False,
                                  timer=Timer() if timing else NO_TIMER, block=block)
            cache, logits, next_pos = compressed.cache, compressed.logits, compressed.next_positions
            prefill = compressed.stats
            stats.update(compressed.stats.items())
        else:
            cache, logits = _full_prefill(model, tokens, positions, room, backend, decode_backend, limit, block)
            next_pos = torch.tensor(lengths, device=model.device)[:, None]  # (B, 1)
            stats["method"] = "full"
    kept = sum(state.cache.nbytes()) if state is not None else sum(cache.nbytes())
    return Started(cache, logits, next_pos, lengths, stats, prefill, kept, batched)


@torch.inference_mode()
def generate_states(model, states, *, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, stop_at_eos: bool = True, compile=True,
                    seed: int | None = None, question=None, recall=None,
                    max_kv_tokens=None) -> list[GenerationResult]:
    """Continue several compressed prompts (`CompressedState`s, e.g. every method's state from
    `structkv.compress_shared`) in one batched decode: their caches are stacked row-wise
    (`StackedKVCache`), so each step reads the weights once for all of them. Each result equals
    `generate(model, ..., method=state.method)` alone; the states are not modified.

    Per-state stats: the state's prefill stats plus the new tokens; the decode time is shared
    (`decode_s`, `decode_rows`), so `decode_tokens_per_s` is not per method and is left NaN.

    `question` (text or ids, the same for every state): appended uncompressed to every stacked
    context before decoding, as `generate(model, question, state=...)` does for one state (the
    states must be compressed with room for it plus the new tokens). `recall`: as in `generate`,
    one for every state or a list with one per state; a state that recalls extends its own copy
    (its answer's cache is its own), then all are stacked for the decode. `max_kv_tokens`: as in
    `generate`, each row evicting on its own (so each result still equals its `generate` alone).
    """
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    if not states:
        raise ValueError("generate_states needs at least one state")
    limit = model.config.max_position_embeddings
    for state in states:
        state.check_model(model)
    cache = StackedKVCache([s.cache for s in states])
    asked = [] if question is None else _question_ids(model, question)
    if cache.free() < len(asked) + (1 if max_kv_tokens is not None else max_new_tokens):
        raise ValueError(f"{len(asked)} question + {max_new_tokens} new tokens exceed the {cache.free()} free cache "
                         "slots of these states; compress with room >= question tokens + max_new_tokens")
    next_pos = torch.cat([s.next_positions for s in states])  # (R, 1)
    if int(next_pos.max()) + len(asked) + max_new_tokens - 1 > limit:
        raise ValueError(f"prompt + {len(asked)} question + {max_new_tokens} new tokens exceed the model's "
                         f"{limit} positions")
    logits = torch.cat([s.logits for s in states])  # (R, V)
    recalls = recall if isinstance(recall, (list, tuple)) else [recall] * len(states)
    if len(recalls) != len(states):
        raise ValueError(f"recall: give one value or one per state ({len(states)}), got {len(recalls)}")
    asks = [{} for _ in states]  # each state's recall stats
    if asked and any(resolve_recall(s, r) is not None for s, r in zip(states, recalls)):
        parts = [_extend_state(model, s, asked, max_new_tokens, r, a, decode_bound=max_kv_tokens is not None)
                 for s, r, a in zip(states, recalls, asks)]
        cache = StackedKVCache([p[0] for p in parts])
        logits, next_pos = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
    elif asked:
        rows = next_pos.shape[0]
        positions = next_pos + torch.arange(len(asked), device=model.device)  # (R, S_q)
        logits = model.extend(torch.tensor([asked], device=model.device).expand(rows, -1), positions, cache)
        next_pos = positions[:, -1:] + 1
    backend = "inductor" if compile is True else compile
    generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    t1 = time.perf_counter()
    step = step_function(backend, device=model.device)
    rows = Decoding(model, cache, logits, next_pos, step, bounded(model, cache, max_kv_tokens))
    ids, steps = decode_tokens(rows, max_new_tokens, temperature, top_k, top_p, stop_at_eos, generator)
    sync(model.device)
    decode_s = time.perf_counter() - t1
    bound_stats = rows.bound.stats() if rows.bound is not None else {}
    results, row = [], 0
    for state, b, ask in zip(states, cache.rows, asks):
        rows = ids[row:row + b]
        row += b
        texts = [model.tokenizer.decode(r) for r in rows] if model.tokenizer is not None else [None] * b
        stats = {**state.stats.as_dict(), "new_tokens": steps, "decode_s": decode_s, "decode_rows": len(ids),
                 "question_tokens": len(asked),
                 "decode_tokens_per_s": float("nan"),
                 "kv_cache_bytes": sum(layer.nbytes() for layer in state.cache.layers),
                 "kv_bytes_kept": sum(state.cache.nbytes()), **ask, **bound_stats}
        results.append(GenerationResult(texts[0] if b == 1 else texts, rows[0] if b == 1 else rows, stats,
                                        state.stats))
    return results


class TextStream:
    """A `stream` callback for one row that writes text as it is produced (through `StopText`
    without stop strings: only complete characters are written until `finish`)."""

    def __init__(self, tokenizer, out):
        self.text, self.out = StopText(tokenizer), out

    def __call__(self, tokens: list[int | None]) -> None:
        if tokens[0] is not None:
            self._write(self.text.push(tokens[0]))

    def finish(self) -> None:
        """Write what was held back (a generation can end inside or on an invalid character)."""
        self._write(self.text.finish())

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def format_stats(stats: dict) -> str:
    """One line for people: prefill time and fraction, pivot, KV kept, decode speed."""
    parts = [f"method {stats.get('method', 'full')}",
             f"prompt {stats['prompt_tokens']} tokens",
             f"prefill {stats['prefill_s']:.2f} s"]
    if stats.get("question_s") is not None:
        parts.append(f"question {stats['question_s']:.2f} s")
    fraction = stats.get("prefill_fraction")
    if fraction is not None:
        parts.append(f"prefill fraction {fraction:.2f}")
    pivot = stats.get("pivot_layer")
    if pivot is not None:
        parts.append(f"pivot layer {pivot}")
    parts.append(f"KV {stats['kv_entries']} entries, {stats['kv_bytes_kept'] / 2**20:.2f} MiB of the prompt kept, "
                 f"{stats['kv_cache_bytes'] / 2**20:.2f} MiB allocated")
    if stats.get("tp_ranks"):
        parts.append(f"tensor parallel over {stats['tp_ranks']} ranks (KV above: this rank's; "
                     f"{stats['kv_bytes_all_ranks'] / 2**20:.2f} MiB kept over all)")
    if stats.get("max_kv_tokens") is not None:
        parts.append(f"KV bound {stats['max_kv_tokens']} per layer ({stats['decode_evict_rule']}): peak "
                     f"{max(stats['kv_entries_max'], default=0)} entries, {stats['kv_evictions']} evictions in "
                     f"{stats['kv_evict_s']:.2f} s")
    parts.append(f"{stats['new_tokens']} new tokens in {stats['decode_s']:.2f} s "
                 f"({stats['decode_tokens_per_s']:.1f} tok/s)")
    if stats.get("recall") is not None:
        parts.append(f"recalled {stats['recalled_entries']} entries ({stats['kv_bytes_recalled'] / 2**20:.2f} MiB) "
                     f"from a {stats['archive_kind']} archive of {stats['archive_bytes'] / 2**20:.2f} MiB"
                     + (f" ({stats['archive_file']})" if stats.get("archive_file") else ""))
    parts.append("compiled " + " and ".join(stats["compiled_parts"]) if stats.get("compiled_parts") else "eager")
    return "structkv: " + ", ".join(parts)


def _chat_prompt(model, prompt, messages, state) -> list[int]:
    """Token ids of a chat turn: the whole conversation, or what follows a state's messages."""
    from ..text import chat

    if prompt is not None:
        raise ValueError("give either a prompt or chat messages, not both")
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: chat messages need one (tokenizer.json in its folder)")
    messages = chat.check_messages(messages)
    if state is None:
        return chat.encode(model.tokenizer, messages)
    if state.messages is None:
        raise ValueError("this state was made from plain text; make it with structkv.prefill(model, messages=...) "
                         "to continue it with chat messages")
    history = list(state.messages)
    if list(messages[:len(history)]) != history:
        raise ValueError("the messages must start with the state's own messages (the conversation so far)")
    return chat.continuation(model.tokenizer, history, list(messages[len(history):]))


def _full_prefill(model, tokens, positions, max_new_tokens, backend, decode_backend, limit, block=None):
    """Uncompressed prefill into a static cache (compiled with a dynamic prompt length; eager
    through `block` when one is given)."""
    B, S = tokens.shape
    capacity = round_capacity(S + max_new_tokens)
    cache = StaticKVCache(model.config, B, capacity, model.dtype, model.device, model.kv_dtype)
    if S == 1:  # a one-token prompt is a decode step (keeps the prefill graph dynamic, min length 2)
        return cache, step_function(decode_backend, device=model.device)(model, tokens, positions, cache)
    if block is not None:
        logits, kv = model.prompt_pass(tokens, positions, block=block)
    else:
        if backend:
            torch._dynamo.mark_dynamic(tokens, 1, min=2, max=limit)
            torch._dynamo.mark_dynamic(positions, 1, min=2, max=limit)
        logits, kv = (compiled_prefill(backend) if backend else _prefill)(model, tokens, positions)
    for layer, (k, v) in zip(cache.layers, kv):
        layer.fill(k, v, positions)
    return cache, logits


def _question_ids(model, question) -> list[int]:
    """A question's token ids (text without BOS, or ids), checked against the vocabulary."""
    if is_batch(question):
        raise ValueError(f"a question to a compressed state is one prompt (text or token ids), the same for every row; "
                         f"got a list of {len(question)} prompts: ask them one at a time, each with state=")
    if isinstance(question, str):
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass the question as token ids")
        ids = model.tokenizer.encode(question, add_bos=False)
    else:
        ids = ids_from_prompt(model, question)
    if not ids:
        raise ValueError("the question is empty: give at least one token")
    bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
    if bad:
        raise ValueError(f"the question has token ids outside the vocabulary [0, {model.config.vocab_size}): {bad[:5]}")
    return ids


def _extend_state(model, state, question, max_new_tokens, recall=None, stats: dict | None = None,
                  decode_bound: bool = False):
    """Append `question` (same for every row) to a copy of the compressed context, recalling
    `recall` entries per archived layer from the state's archive (None: the state's default; 0:
    none); what recall did goes into `stats`. `decode_bound`: the decode keeps a KV bound, so the
    state needs room for the question and one token (the bound's eviction makes the rest).

    Returns the extended cache, the question's last logits (B, V), the next positions (B, 1) and
    the tokens per row so far."""
    ids = _question_ids(model, question)
    state.check_model(model)
    end = int(state.next_positions.max()) + len(ids) + max_new_tokens - 1
    if end > model.config.max_position_embeddings:
        raise ValueError(f"context ({int(state.next_positions.max())} tokens) + question ({len(ids)}) + "
                         f"{max_new_tokens} "
                         f"new tokens exceed the model's {model.config.max_position_embeddings} positions; "
                         "ask for fewer tokens or compress a shorter context")
    B = state.logits.shape[0]
    free = min(layer.capacity - int(layer.cursor) for layer in state.cache.layers if layer.sliding_window is None)
    if len(ids) + (1 if decode_bound else max_new_tokens) > free:
        raise ValueError(f"question ({len(ids)} tokens) + {max_new_tokens} new tokens exceed the {free} free cache "
                         "slots of this state; call structkv.prefill(model, context, method, room=...) with more room")
    tokens = torch.tensor([ids], device=model.device).expand(B, -1)  # (B, S_q)
    positions = state.next_positions + torch.arange(len(ids), device=model.device)  # (B, S_q)
    recall = resolve_recall(state, recall)
    if recall is None:
        cache = state.cache.clone()
        logits = model.extend(tokens, positions, cache)
    else:
        from ..modules.recall import recall_extend

        t0 = time.perf_counter()
        cache, logits, done = recall_extend(model, state, tokens, positions, recall)
        sync(model.device)
        if stats is not None:
            stats.update(recall_stats(state, recall, done, time.perf_counter() - t0))
    lengths = [n + len(ids) for n in state.lengths]
    return cache, logits, positions[:, -1:] + 1, lengths


def resolve_recall(state, recall):
    """The recall budget a question on `state` uses: `recall` (0: none), or the state's default;
    None when nothing is recalled. A budget without an archive is refused."""
    from ..modules.budget import Budget

    if isinstance(recall, (int, float)) and not isinstance(recall, bool) and recall == 0:
        return None
    if recall is None:
        return state.recall if state.archive is not None else None
    if state.archive is None:
        raise ValueError("recall= needs a state with an archive of its evicted entries: make it with "
                         "structkv.prefill(model, context, method, archive='int4')")
    return Budget.parse(recall, "recall").value


def recall_stats(state, recall, done: dict, seconds: float) -> dict:
    """What a question's recall did, for its stats: the budget, entries recalled from the archive,
    the archive's size and the bytes read from it, and the seconds the question's extension took."""
    return {"recall": recall, "recalled_entries": done["recalled"], "recall_chosen": done["chosen"],
            "kv_bytes_recalled": done["recalled_bytes"], "recall_kernel": done["kernel"],
            "archive_kind": state.archive.kind, "archive_bytes": state.archive.nbytes(),
            "archive_entries": state.archive.entries(), "archive_bytes_read": done["archive_bytes_read"],
            "archive_file": str(state.archive.path) if state.archive.path is not None else None,
            "question_s": seconds}
