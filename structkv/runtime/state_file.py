"""A compressed state in one file: hot set, last logits, positions and the archive, so a server
restarted (or another process) answers from a document compressed before, never compressing it
again, and never from a file it cannot trust.

The file is a safetensors file: the hot set's planes per layer (`hot.<i>.<plane>`, its positions
and cursor), `logits`, `next_positions`, `kept_columns`, the archive's tensors as
`structkv.models.archive` writes them, and in its metadata the layout (ring windows, kv_dtype),
the prompt lengths, the prefill stats, the recall budget and a CRC-32 of every tensor. Loading
copies the hot set into RAM (decode reads it every step) and leaves the archive in the file, read
and checked by each question. A corrupt, truncated, changed or removed file raises `ArchiveError`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..models.archive import ArchiveError, crc_check, from_tensors, read_file, write_file
from ..models.kv_cache import KVCache, LayerKVCache
from .stats import PrefillStats

STATE_FORMAT = "structkv-state/2"  # 2: its archive's int4 keys per channel


def save_state(state, path) -> None:
    """Write `state` (a `CompressedState`, its archive included when it has one) to `path`, whole
    or not at all. The state's archive then reads from the file."""
    tensors = {"logits": state.logits, "next_positions": state.next_positions}
    if state.kept_columns is not None:
        tensors["kept_columns"] = state.kept_columns
    layout = []
    for i, layer in enumerate(state.cache.layers):
        for name in (*layer.planes, "pos", "cursor"):
            tensors[f"hot.{i}.{name}"] = getattr(layer, name)
        layout.append({"window": layer.sliding_window, "capacity": layer.capacity, "head_dim": layer.head_dim,
                       "kv_dtype": layer.kv_dtype})
    archive = state.archive
    meta = {"format": STATE_FORMAT, "layout": json.dumps(layout), "lengths": json.dumps(state.lengths),
            "stats": json.dumps(dataclasses.asdict(state.stats) if state.stats is not None else None),
            "recall": json.dumps(state.recall), **(archive.meta() if archive is not None else {})}
    write_file(path, {**tensors, **(archive.tensors() if archive is not None else {})}, meta)
    if archive is not None:
        meta, mapped = read_file(Path(path), STATE_FORMAT, "state file")
        state.archive = from_tensors(Path(path), mapped, meta)


def load_state(path, model, method):
    """The `CompressedState` in `path` for `model`, made by `method` (the caller's key names it).
    The hot set is read once, checked (CRC) and copied into RAM; the archive stays in the file and
    each question reads and checks the layers it recalls from. Raises `ArchiveError` for a file
    that cannot be trusted."""
    import weakref

    from .compress import CompressedState

    path = Path(path)
    meta, tensors = read_file(path, STATE_FORMAT, "state file")
    try:
        crc = json.loads(meta["crc32"])
        archive, tensors = tensors, {n: tensors[n] for n in tensors if not n[0].isdigit()}  # the hot set read once
        crc_check(path, {n: (t, crc[n]) for n, t in tensors.items()})()  # and checked; the archive at each read
        layers = []
        for i, spec in enumerate(json.loads(meta["layout"])):
            first = tensors[f"hot.{i}.pos"]
            layer = LayerKVCache(first.shape[0], first.shape[1], spec["capacity"], spec["head_dim"],
                                 model.dtype, model.device, sliding_window=spec["window"], kv_dtype=spec["kv_dtype"])
            for name in (*layer.planes, "pos", "cursor"):
                getattr(layer, name).copy_(tensors[f"hot.{i}.{name}"])
            layers.append(layer)
        stats = json.loads(meta["stats"])
        state = CompressedState(KVCache(), tensors["logits"].clone(), tensors["next_positions"].clone(),
                                json.loads(meta["lengths"]), method, PrefillStats(**stats) if stats else None,
                                tensors["kept_columns"].clone() if "kept_columns" in tensors else None,
                                weakref.ref(model), recall=json.loads(meta["recall"]))
        state.cache.layers = torch.nn.ModuleList(layers)
        if "kind" in meta:
            state.archive = from_tensors(path, archive, meta)
        return state
    except (KeyError, TypeError, RuntimeError, json.JSONDecodeError) as e:
        raise ArchiveError(f"state file {path} does not hold a state for this model ({type(e).__name__}: {e}); "
                           "delete it: the context is compressed again") from None
