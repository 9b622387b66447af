"""compress: the one prefill, for one method or many at once, and `prefill` (compress once, ask many).

`compress(model, ..., method)` is the shared pass (`structkv.runtime.lanes`) with one method;
`compress_shared` runs many methods in one pass, grouped by the probe they add; calibration
(`structkv.runtime.calibration`) is the same pass with an observer. Rooms: the state and its
statistics (`compressed_state`), one method's share and the per-layer sequence (`method_pass`), the
lane/fork engine (`lanes`), where the seconds go (`ledger`).
"""
from __future__ import annotations

import torch

from ..methods import Full, Method
from ..text.prompts import encode_batch, is_batch
from ..util.timing import NO_TIMER, Timer
from . import probe as probing
from .compressed_state import CompressedState, prefill_stats
from .lanes import layer_block, run_pass
from .method_pass import MethodPass, layer_steps, prepare

__all__ = ["CompressedState", "MethodPass", "check_scorable", "compress", "compress_shared", "layer_block",
           "layer_steps", "prefill", "prefill_stats", "prepare"]


def check_scorable(cfg) -> None:
    if not cfg.full_attention_layers:
        raise ValueError("the model has no full-attention layer to score; compression needs one")

@torch.inference_mode()
def compress(model, tokens: torch.Tensor, positions: torch.Tensor, method: Method | None = None,
             room: int = 256, compile=False, timer: Timer = NO_TIMER, archive: str | None = None,
             block=None) -> CompressedState:
    """Prefill `tokens` (B, S) at `positions` (B, S) (-1 = left padding) with `method`.

    `room`: cache slots after the kept entries for tokens appended later (generation, questions).
    `compile`: False (eager), True (inductor) or a backend: each layer block runs compiled with a
    dynamic length. `timer`: a `structkv.util.timing.Timer` to fill the phase times of the stats.
    `archive`: also keep every evicted entry, in this kind ("int4", "int8", "bf16", "float"), as
    the state's `archive`, so a question can recall them (`structkv.generate(..., recall=...)`).
    `block`: how each layer runs (`Decoder.run`'s `block`, e.g. `structkv.models.sliced.sliced_block`,
    which makes way for other work between slices); it replaces `compile`'s.
    """
    return compress_shared(model, tokens, positions, [method], room, compile, timer=timer, archive=archive,
                           block=block)[0]

@torch.inference_mode()
def compress_shared(model, tokens: torch.Tensor, positions: torch.Tensor, methods: list[Method],
                    room: int = 256, compile=False, timer: Timer | None = None, observe=None,
                    archive: str | None = None, block=None) -> list[CompressedState]:
    """Compress `tokens` (B, S) at `positions` with every method of `methods` in one pass; the
    states come back in the order of `methods`. `timer`: phase timer (default: one, so each
    method's share can be told); `observe(view)`: called with every layer's `LayerView` of the
    first stream (calibration reads the pivot statistics there); `archive`: see `compress`
    (every state keeps its own evicted entries), or a list with one kind (or None) per method;
    `block`: see `compress`."""
    from ..models.archive import check_kind

    methods = [m or Full() for m in methods]
    if not methods:
        raise ValueError("compress_shared needs at least one method")
    check_scorable(model.config)
    kinds = list(archive) if isinstance(archive, (list, tuple)) else [archive] * len(methods)
    if len(kinds) != len(methods):
        raise ValueError(f"archive: give one kind or one per method ({len(methods)}), got {len(kinds)}")
    for kind in kinds:
        check_kind(kind)
    if any(kinds) and getattr(model, "tp", None) is not None:
        raise ValueError("an archive (ask-time recall) is not supported under tensor parallelism yet; use archive=None")
    timer = Timer() if timer is None else timer
    groups: dict[str | None, list[int]] = {}  # methods with one probe run on the same tokens
    for i, m in enumerate(methods):
        groups.setdefault(probing.probe_of(m), []).append(i)
    out = [None] * len(methods)
    for text, index in groups.items():
        group, archives = [methods[i] for i in index], [kinds[i] for i in index]
        if text is None:
            states = run_pass(model, tokens, positions, group, room, compile, timer, observe, archive=archives,
                               block=block)
        else:
            ids = probing.probe_ids(model, text)
            ext, ext_pos = probing.extend(tokens, positions, ids)
            states = run_pass(model, ext, ext_pos, [probing.widened(m, len(ids)) for m in group], room, compile,
                               timer, observe, probe=len(ids), archive=archives, block=block)
        for i, method, state in zip(index, group, states):
            state.method, out[i] = method, state
    return out

def prefill(model, context=None, method: Method | None = None, *, messages=None, room: int = 256,
            compile=False, archive: str | None = None, recall=None, archive_dir=None, block=None) -> CompressedState:
    """Compress once, ask many: prefill `context` (text, ids or a batch) with `method` and return
    a reusable `CompressedState`; pass it to `structkv.generate(model, question, state=...)`.
    `messages` instead of `context`: a conversation rendered by the model's chat template (e.g. a
    user turn holding a long document); later turns go to `generate(messages=..., state=...)`.

    Ask-time recall: `archive` ("int4", "int8", "bf16" or "float") keeps what the method evicted,
    stored small, and every question then recalls `recall` entries per archived layer (a ratio of
    the context or a count; default `structkv.modules.recall.DEFAULT_RECALL`) chosen by its own
    attention (`structkv.modules.recall`). `archive_dir`: the archive goes to a file there
    (read and checked at each question; RAM then holds only the hot set). `block`: see `compress`."""
    from ..modules.budget import Budget
    from ..modules.recall import DEFAULT_RECALL

    if isinstance(method, str):
        from ..methods import get

        method = get(method)
    if archive is None and (recall is not None or archive_dir is not None):
        raise ValueError("recall= and archive_dir= need an archive of the evicted entries: pass archive='int4' "
                         "(or 'int8', 'bf16', 'float')")
    if recall is not None:
        recall = Budget.parse(recall, "recall").value
    if (context is None) == (messages is None):
        raise ValueError("give the context either as `context` (text or ids) or as chat `messages`")
    if messages is not None:
        from ..text.chat import encode as encode_chat

        context = encode_chat(_tokenizer(model), messages, add_generation_prompt=False)
    tokens, positions, _ = encode_batch(model, context if is_batch(context) else [context])
    state = compress(model, tokens, positions, method, room=room, compile=compile, archive=archive, block=block)
    state.messages = list(messages) if messages is not None else None
    if state.archive is not None:
        state.recall = DEFAULT_RECALL if recall is None else recall
        if archive_dir is not None:
            import uuid
            from pathlib import Path

            state.archive = state.archive.save(Path(archive_dir) / f"{uuid.uuid4().hex}.safetensors")
    return state

def _tokenizer(model):
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: chat messages need one (tokenizer.json in its folder)")
    return model.tokenizer
