"""A compressed state in one file: hot set, last logits, positions and the archive, so a server
restarted (or another process) answers from a document compressed before, never compressing it
again, and never from a file it cannot trust.

The file is a safetensors file: the hot set's planes per layer (`hot.<i>.<plane>`, its positions
and cursor), `logits`, `next_positions`, `kept_columns`, the archive's tensors as
`structkv.models.archive` writes them, and in its metadata the layout (ring windows, kv_dtype),
the prompt lengths, the prefill stats, the recall budget and a CRC-32 of every tensor. Loading
copies the hot set into RAM (decode reads it every step) and leaves the archive memory-mapped.
A corrupt or truncated file raises `ArchiveError`.
"""
from __future__ import annotations

import dataclasses
import io
import json
import zlib
from pathlib import Path

import torch

from ..files import write_atomic
from ..stats import PrefillStats
from .archive import ArchiveError, KVArchive, _bytes, _mapped, from_tensors
from .kv_cache import KVCache, LayerKVCache

STATE_FORMAT = "structkv-state/1"


def save_state(state, path) -> None:
    """Write `state` (a `CompressedState`, its archive included when it has one) to `path`, whole
    or not at all. The state's archive then reads from the file."""
    from safetensors.torch import save

    tensors = {"logits": state.logits, "next_positions": state.next_positions}
    if state.kept_columns is not None:
        tensors["kept_columns"] = state.kept_columns
    layout = []
    for i, layer in enumerate(state.cache.layers):
        for name in (*layer.planes, "pos", "cursor"):
            tensors[f"hot.{i}.{name}"] = getattr(layer, name)
        layout.append({"window": layer.window, "capacity": layer.capacity, "head_dim": layer.head_dim,
                       "kv_dtype": layer.kv_dtype})
    archive = state.archive
    if archive is not None:
        for i, layer in archive.layers.items():
            for j, plane in enumerate(layer.planes):
                tensors[f"{i}.{j}"] = plane
            tensors[f"{i}.pos"] = layer.pos
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    meta = {"format": STATE_FORMAT, "layout": json.dumps(layout), "lengths": json.dumps(state.lengths),
            "stats": json.dumps(dataclasses.asdict(state.stats) if state.stats is not None else None),
            "recall": json.dumps(state.recall),
            "crc32": json.dumps({n: zlib.crc32(_bytes(t)) for n, t in tensors.items()})}
    if archive is not None:
        meta.update({"kind": archive.kind, "layers": json.dumps(sorted(archive.layers))})
    write_atomic(io.BytesIO(save(tensors, metadata=meta)), Path(path))
    if archive is not None:
        meta, mapped = _open(Path(path))
        state.archive = _archive(Path(path), mapped, meta)


def _open(path: Path):
    """(metadata, tensors mapped) of a state file, or ArchiveError."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ArchiveError(f"state file {path} does not exist")
    try:
        with safe_open(str(path), "pt") as f:
            meta, names = f.metadata() or {}, list(f.keys())
        if meta.get("format") != STATE_FORMAT:
            raise ArchiveError(f"{path} is not a structkv state file ({meta.get('format')!r})")
        return meta, _mapped(path, names)
    except (SafetensorError, ValueError, OSError, json.JSONDecodeError) as e:
        if isinstance(e, ArchiveError):
            raise
        raise ArchiveError(f"state file {path} is corrupt or truncated ({e}); delete it: the context is compressed "
                           "again") from None


def _archive(path: Path, tensors: dict, meta: dict) -> KVArchive:
    return from_tensors(path, tensors, meta["kind"], json.loads(meta["layers"]), json.loads(meta["crc32"]))


def load_state(path, model, method):
    """The `CompressedState` in `path` for `model`, made by `method` (the caller's key names it).
    The hot set is checked (CRC) and copied into RAM; the archive stays mapped and is checked when
    a question first reads it. Raises `ArchiveError` for a file that cannot be trusted."""
    import weakref

    from ..compress import CompressedState

    path = Path(path)
    meta, tensors = _open(path)
    try:
        crc = json.loads(meta["crc32"])
        for name, t in tensors.items():
            if not name[0].isdigit() and zlib.crc32(_bytes(t)) != crc[name]:  # the archive: at first read
                raise ArchiveError(f"state file {path} is corrupt (tensor {name} fails its CRC-32); delete it: the "
                                   "context is compressed again")
        layers = []
        for i, spec in enumerate(json.loads(meta["layout"])):
            first = tensors[f"hot.{i}.pos"]
            layer = LayerKVCache(first.shape[0], first.shape[1], spec["capacity"], spec["head_dim"],
                                 model.dtype, model.device, window=spec["window"], kv_dtype=spec["kv_dtype"])
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
            state.archive = _archive(path, tensors, meta)
        return state
    except (KeyError, TypeError, RuntimeError, json.JSONDecodeError) as e:
        raise ArchiveError(f"state file {path} does not hold a state for this model ({type(e).__name__}: {e}); "
                           "delete it: the context is compressed again") from None
