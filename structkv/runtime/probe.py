"""A probe: a short text appended to the context during compression only, whose queries form the
observation window of a window-scored method (SnapKV, PyramidKV, FastKV, StructKV).

Why: compressed once and asked many questions later, a context has no question in it, and the
observation window is the context's last sentences, which attend to their own neighbourhood and
point at nothing a later question will ask for (every window method keeps 0-8 % on RULER 4K there).
A probe such as "what does the text above say?" is a query that asks for the content in general;
it costs its few tokens of prefill, so StructKV keeps its prefill saving.

The probe is never part of the state: the method runs with its window widened by the probe's
length (the probe plus the context's last `window` tokens are the window, always kept), then the
probe's entries are dropped from every layer (empty slots), the next position is the context's end
and the logits are the context's last token's. A sliding-window layer's ring holds the last
`window` positions of context + probe, so after the drop it holds `window - probe` context tokens
(the oldest `probe` tokens of its span are gone).
"""
from __future__ import annotations

import dataclasses

import torch


def probe_of(method) -> str | None:
    return getattr(method, "probe", None)


def probe_ids(model, text: str) -> list[int]:
    if model.tokenizer is None:
        raise ValueError("a probe is text: this model has no tokenizer (tokenizer.json in its folder); "
                         "use the method without `probe`")
    ids = model.tokenizer.encode(text, add_bos=False)
    if not ids:
        raise ValueError(f"the probe {text!r} encodes to no tokens; give a non-empty probe")
    return ids


def extend(tokens: torch.Tensor, positions: torch.Tensor, ids: list[int]):
    """The context (B, S) at `positions` followed by the probe: (B, S + P) tokens and positions."""
    B = tokens.shape[0]
    probe = torch.tensor(ids, dtype=tokens.dtype, device=tokens.device).expand(B, -1)  # (B, P)
    after = positions.max(dim=1, keepdim=True).values + 1 + torch.arange(len(ids), device=positions.device)
    return torch.cat([tokens, probe], 1), torch.cat([positions, after], 1)


def widened(method, extra: int):
    """`method` with its window widened by the probe's `extra` tokens and no probe (what runs)."""
    observe = {"observe": method.observe + extra} if getattr(method, "observe", None) is not None else {}
    out = dataclasses.replace(method, window=method.window + extra, probe=None, **observe)
    out.name = method.name
    return out


def drop(state, probe_len: int) -> None:
    """Remove the probe from a state made on context + probe: its entries (positions >= the
    context's end) become empty slots; the next position and the kept columns are the context's."""
    end = state.next_positions - probe_len  # (B, 1): the context's next position
    for layer in state.cache.layers:
        layer.pos.masked_fill_(layer.pos >= end[:, :, None], -1)  # (B, Hkv, C)
    if state.archive is not None:  # entries of the probe are never context to recall
        for layer in state.archive.layers.values():
            layer.pos.masked_fill_(layer.pos >= end.view(1, -1, 1), -1)  # (A, B, Hkv)
    state.next_positions = end
    if state.kept_columns is not None:
        cols = state.kept_columns
        state.kept_columns = cols[:, :cols.shape[1] - probe_len]  # the probe's columns are the last ones
