"""Prompts to token tensors: text, ids or arrays of one prompt or a batch, left-padded.

Padding has position -1, so it is never a visible key and every row gets exactly what it would
get alone. Every bad prompt is a TypeError or ValueError that says what a prompt may be.
"""
from __future__ import annotations

import numbers

import torch

PROMPT_TYPES = "a str, a list of int token ids, or a 1-D integer tensor or array"


def ids_from_prompt(model, prompt) -> list[int]:
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError("a prompt given as bytes is ambiguous (text or token ids?): pass text as str "
                        "(prompt.decode('utf-8')) or ids as a list of int")
    if prompt is None or isinstance(prompt, (bool, numbers.Number)):
        raise TypeError(f"a prompt must be {PROMPT_TYPES}, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of text")
        return model.tokenizer.encode(prompt)
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.is_complex():
            raise ValueError(f"a token tensor must be 1-D integer ids, got {prompt.dim()}-D {prompt.dtype}")
        if prompt.device != model.device:
            raise ValueError(f"prompt tensor is on {prompt.device} but the model is on {model.device}; "
                             "move one of them")
        return prompt.tolist()
    if hasattr(prompt, "dtype") and hasattr(prompt, "ndim"):  # numpy arrays
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise ValueError(f"a token array must be 1-D integer ids, got {prompt.ndim}-D {prompt.dtype}")
    try:
        ids = list(prompt)
    except TypeError:
        raise TypeError(f"a prompt must be {PROMPT_TYPES}, got {type(prompt).__name__}") from None
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"a prompt must be {PROMPT_TYPES}; this list holds non-integers")
    return [int(i) for i in ids]


def is_batch(prompt) -> bool:
    """A list of prompts (texts or id lists), as opposed to one prompt given as a list of ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], numbers.Integral)


def encode_batch(model, prompts) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Left-pad a batch: tokens (B, S), positions (B, S) with -1 on padding, and each row's length."""
    rows = [ids_from_prompt(model, p) for p in prompts]
    cfg = model.config
    for b, ids in enumerate(rows):
        if not ids:
            raise ValueError(f"prompt {b} is empty: give at least one token")
        bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {b} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
    S = max(len(r) for r in rows)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    tokens = torch.full((len(rows), S), pad, dtype=torch.long)
    positions = torch.full((len(rows), S), -1, dtype=torch.long)
    for b, ids in enumerate(rows):
        tokens[b, S - len(ids):] = torch.tensor(ids)
        positions[b, S - len(ids):] = torch.arange(len(ids))
    return tokens.to(model.device), positions.to(model.device), [len(r) for r in rows]
