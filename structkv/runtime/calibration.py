"""calibrate: fix StructKV's pivot for a model from a few prompts (the paper's offline mode).

Each prompt runs through the one prefill loop (`structkv.runtime.compress.compress_shared`) with an
observer: the detector sees every scored layer without firing (its statistics over the whole
depth and its T curve over the candidate range are kept in the returned traces); the mean T
curve's peak, `confirm` candidate layers later, becomes the method's fixed pivot. A fixed pivot
costs the same prefill on every input (one host decision), which the per-input detector does not.
"""
from __future__ import annotations

import dataclasses

import torch

from ..methods import Full, Method, StructKV, takes
from ..modules.pivot import PivotDetector, PivotTrace, calibrate_pivot
from ..text.prompts import encode_batch
from ..util.timing import NO_TIMER
from .compress import check_scorable, compress_shared


@torch.inference_mode()
def calibrate(model, prompts: list, method: StructKV | None = None) -> tuple[StructKV, list[PivotTrace]]:
    """(the method with `pivot` fixed to the calibrated layer, one trace per prompt)."""
    method = method or StructKV()
    if not isinstance(method, Method) or not takes(method, "pivot"):
        raise TypeError(f"calibrate sets StructKV's pivot; got {type(method).__name__}")
    if not prompts:
        raise ValueError("calibrate needs at least one prompt (text or token ids)")
    cfg = model.config
    check_scorable(cfg)
    scored = cfg.full_attention_layers
    settings = method.settings()
    detector = PivotDetector.from_config(cfg.num_layers, scored, settings)
    detector.observe_all = True  # record every scored layer, never fire

    def observe(view):
        if view.layer in scored:
            detector(view.layer, view.window_scores(settings.window), view.positions, settings.window, view.lengths)

    traces = []
    for prompt in prompts:
        tokens, positions, _ = encode_batch(model, [prompt])
        detector.reset(1)
        compress_shared(model, tokens, positions, [Full()], room=0, timer=NO_TIMER, observe=observe)
        traces.append(detector.traces[0])
    fixed = dataclasses.replace(method, pivot=calibrate_pivot(traces, detector.candidates, method.confirm))
    fixed.name = method.name  # a registry name (e.g. structkv_paper) stays the method's name
    return fixed, traces
