"""The archive of a compressed state: the KV entries its method evicted, stored small.

Eviction decided before the question is a guess; the archive keeps what the guess dropped, so a
question can recall it at ask time (`structkv.modules.recall`). Per archived layer (a layer whose
entries the method selected: the full-attention layers of a compressing method), the entries
every (row, KV head) did not keep, in `kind`:
- "int4": keys as int4 codes with a scale and minimum per channel over blocks of 32 entries
  (`quantize_int4_channels`, KIVI's key layout: keys' outlier channels are shared by every token),
  values as the per-entry int4 of `structkv.ops.kv_quant` (a scale and minimum per 32 dimensions);
  both keep two codes a byte and cost the same bytes per entry;
- "int4_token": keys per entry too (format 1's int4, kept to compare: its rounding of the small
  key channels cost Gemma 3 270M 12 points of fact lookup, research/results/archive_fidelity);
- "int8": the codes and per-entry scale of `structkv.ops.kv_quant`;
- "bf16": 16-bit floats; "float": the model's own dtype (exact: a reference, not a saving).

Layout: entry-major, every plane (A, B, Hkv, last) and positions (A, B, Hkv) int32 (-1: no
entry; rows and heads of one layer evict the same number of entries, so only rows shorter than
the longest pad, with copies of their last entry). Per-channel tables are (ceil(A / 32), B, Hkv,
D): one per block of 32 entries. Entry-major so that a tile of entries is one contiguous block, in
memory and in a file, and `tile(s, e)` (s a multiple of 32) reads only that block.

In a file (`save` / `open`), the archive is a safetensors file whose layers are read when a
question needs them (`ArchiveLayer.opened`: one layer at a time, into memory, for that question
only), so a server can keep many archives on disk and only their hot sets in RAM. Every tensor's
CRC-32 is in the file's metadata and checked at every read: a file that is corrupt, truncated,
rewritten in place or gone is refused with `ArchiveError`, never read as wrong entries. The file
is read with pread, not mapped, so a file truncated under a running server is a short read, not
a SIGBUS that kills it.
"""
from __future__ import annotations

import io
import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from ..ops.kv_quant import CHANNEL_BLOCK, dequantize_int4_channels, dequantize_kv, quantize_int4_channels, quantize_kv
from ..util.files import write_atomic

KINDS = ("int4", "int4_token", "int8", "bf16", "float")
FORMAT = "structkv-archive/2"  # 2: "int4" keys per channel
DTYPES = {"U8": torch.uint8, "I8": torch.int8, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
          "F64": torch.float64, "I32": torch.int32, "I64": torch.int64}  # safetensors' names
PLANES = {"int4": 3, "int4_token": 3, "int8": 2, "bf16": 1, "float": 1}  # planes per side (codes, then tables)


class ArchiveError(ValueError):
    """An archive file that cannot be trusted (corrupt, truncated, of another format)."""


def check_kind(kind) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"archive must be None (no archive), 'int4', 'int4_token' (int4 keys per entry), 'int8', "
                         f"'bf16' or 'float' (the model's dtype, exact), got {kind!r}")


def channels(kind: str, side: str) -> bool:
    """Whether `side`'s tables are per channel over blocks of entries (an int4 archive's keys)."""
    return kind == "int4" and side == "k"


def encode(x: torch.Tensor, kind: str, side: str) -> tuple[torch.Tensor, ...]:
    """x (A, ..., D) float, entries first -> the planes of `kind` for `side` ("k" or "v")."""
    if kind == "float":
        return (x,)
    if channels(kind, side):
        return quantize_int4_channels(x)
    return quantize_kv(x, _per_entry(kind))


def decode_run(planes: list[torch.Tensor], kind: str, side: str, dtype=torch.float32) -> torch.Tensor:
    """Entry-major planes of a run of entries that starts at a block (codes (t, ...), per-channel
    tables one row per block) -> x (t, ..., D). Each block's tables broadcast over its entries
    (never repeated per entry in memory)."""
    if not channels(kind, side):
        return decode(planes, kind, side, dtype)
    codes, scale, lo = planes
    t, full = codes.shape[0], codes.shape[0] // CHANNEL_BLOCK * CHANNEL_BLOCK
    out = torch.empty(t, *scale.shape[1:], dtype=dtype, device=codes.device)  # (t, ..., D)
    if full:
        blocks = codes[:full].unflatten(0, (-1, CHANNEL_BLOCK))  # (t/32, 32, ..., D/2)
        n = full // CHANNEL_BLOCK
        out[:full] = dequantize_int4_channels(blocks, scale[:n, None], lo[:n, None], dtype).flatten(0, 1)
    if t > full:  # the last, partial block
        out[full:] = dequantize_int4_channels(codes[full:], scale[-1:], lo[-1:], dtype)
    return out


def decode(planes, kind: str, side: str, dtype=torch.float32) -> torch.Tensor:
    """Planes with one table row per entry (per-channel tables gathered per entry) -> x (..., D)."""
    if kind == "float":
        return planes[0].to(dtype)
    if channels(kind, side):
        return dequantize_int4_channels(*planes, dtype)
    return dequantize_kv(planes, _per_entry(kind), dtype)


def _per_entry(kind: str) -> str:
    """The `structkv.ops.kv_quant` kind of a side stored per entry ("int4_token" is its "int4")."""
    return "int4" if kind == "int4_token" else kind


class ArchiveLayer:
    """One layer's evicted entries: `planes` (k's planes then v's, each (A, B, Hkv, last); an int4
    archive's key tables (ceil(A / 32), B, Hkv, D)) and `pos` (A, B, Hkv). `tile(s, e)` gives
    entries s..e-1 as floats (B, Hkv, t, D); `take(index)` gathers single entries.

    A layer in a file (`source`: the file's tensors, the layer's names, their CRC-32s) holds no
    entries itself: `opened()` reads and checks them into a layer in memory, for one question."""

    def __init__(self, kind: str, planes: list[torch.Tensor] | None, pos: torch.Tensor | None, source=None):
        self.kind, self.planes, self.pos, self.source = kind, planes, pos, source

    @property
    def size(self) -> int:
        if self.source is not None:
            files, names, _ = self.source
            return files.shape(names[-1])[0]
        return self.pos.shape[0]

    def opened(self) -> "ArchiveLayer":
        """This layer with its entries in memory: itself, or its file's tensors read now and
        checked against their CRC-32s (`ArchiveError` for a file changed or gone since it was
        written). Read once per question: the file may change between questions."""
        if self.source is None:
            return self
        files, names, crcs = self.source
        tensors = [files[name] for name in names]
        crc_check(files.path, {name: (t, crcs[name]) for name, t in zip(names, tensors)})()
        return ArchiveLayer(self.kind, tensors[:-1], tensors[-1])

    def to(self, device) -> "ArchiveLayer":
        """This layer with its entries on `device` (the question's: a file's layers are read into
        host memory, then copied, one layer at a time, never the whole archive)."""
        self._ready()
        if self.pos.device == torch.device(device):
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return ArchiveLayer(self.kind, [move(p) for p in self.planes], move(self.pos))

    def pinned(self) -> "ArchiveLayer":
        """This layer with its host entries in pinned memory, what a GPU copies from without the
        host waiting; a layer already on a GPU as it is."""
        self._ready()
        if self.pos.device.type != "cpu":
            return self
        return ArchiveLayer(self.kind, [p.pin_memory() for p in self.planes], self.pos.pin_memory())

    def _ready(self) -> None:
        if self.source is not None:
            raise RuntimeError("a layer in a file is read through opened() (once per question)")

    def positions(self) -> torch.Tensor:
        """(B, Hkv, A) int64 original positions, -1 = none."""
        self._ready()
        return self.pos.permute(1, 2, 0).long()

    def tile(self, s: int, e: int, side: str, dtype=torch.float32) -> torch.Tensor:
        """Keys (`side` "k") or values ("v") of entries s..e-1 as floats (B, Hkv, t, D); s a
        multiple of 32 (a block's tables are read whole)."""
        self._ready()
        return decode_run(self._read(s, e, side), self.kind, side, dtype).permute(1, 2, 0, 3)

    def tile_bytes(self, s: int, e: int, side: str) -> int:
        """Bytes `tile(s, e, side)` reads."""
        return sum(p.numel() * p.element_size() for p in self._read(s, e, side))

    def _read(self, s: int, e: int, side: str) -> list[torch.Tensor]:
        """The planes' rows that hold entries s..e-1 (tables per channel: their blocks)."""
        planes = self._side(side)
        if not channels(self.kind, side):
            return [p[s:e] for p in planes]
        if s % CHANNEL_BLOCK:
            raise ValueError(f"an int4 archive's keys are read in blocks of {CHANNEL_BLOCK} entries: a tile must start "
                             f"at a multiple of {CHANNEL_BLOCK}, got {s}")
        return [planes[0][s:e]] + [p[s // CHANNEL_BLOCK:-(-e // CHANNEL_BLOCK)] for p in planes[1:]]

    def _side(self, side: str) -> list[torch.Tensor]:
        half = len(self.planes) // 2
        return self.planes[:half] if side == "k" else self.planes[half:]

    def take(self, index: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries at `index` (B, Hkv, K) (entry numbers, each < size) as floats (B, Hkv, K, D)."""
        self._ready()
        B, H, K = index.shape
        rows = torch.arange(B, device=index.device).view(B, 1, 1)
        heads = torch.arange(H, device=index.device).view(1, H, 1)
        out = []
        for side in ("k", "v"):
            planes = self._side(side)
            blocks = index // CHANNEL_BLOCK if channels(self.kind, side) else index  # the entry's table row
            picked = [planes[0][index, rows, heads]] + [p[blocks, rows, heads] for p in planes[1:]]  # (B, Hkv, K, last)
            out.append(decode(picked, self.kind, side, dtype))
        return out[0], out[1]

    def nbytes(self) -> int:
        """Bytes of the entries' planes and positions (padding included)."""
        if self.source is not None:
            files, names, _ = self.source
            return sum(files.nbytes(name) for name in names)
        return sum(p.numel() * p.element_size() for p in self.planes) + self.pos.numel() * self.pos.element_size()

    def entries(self) -> int:
        """Archived (entry, KV head) pairs over every row (a file's positions read for the count)."""
        pos = self.source[0][self.source[1][-1]] if self.source is not None else self.pos
        return int((pos >= 0).sum())


class KVArchive:
    """The evicted entries of every archived layer (`layers`: layer index -> `ArchiveLayer`);
    `path`: the file it lives in, None in memory."""

    def __init__(self, kind: str, layers: dict[int, ArchiveLayer], path: Path | None = None):
        self.kind, self.layers, self.path = kind, layers, path

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers.values())

    def entries(self) -> int:
        """Archived (entry, KV head) pairs over every layer and row."""
        return sum(layer.entries() for layer in self.layers.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every plane and the positions by file name (`<layer>.<plane>`, `<layer>.pos`)."""
        out = {}
        for i, layer in self.layers.items():
            layer = layer.opened()
            for j, plane in enumerate(layer.planes):
                out[f"{i}.{j}"] = plane
            out[f"{i}.pos"] = layer.pos
        return out

    def meta(self) -> dict[str, str]:
        """What a file's metadata says of the archive (its kind and layers)."""
        return {"kind": self.kind, "layers": json.dumps(sorted(self.layers))}

    def save(self, path) -> "KVArchive":
        """Write to `path` (a safetensors file, written whole or not at all) and return the archive
        read back from it (memory-mapped: this one's tensors can then be freed)."""
        write_file(path, self.tensors(), {"format": FORMAT, **self.meta()})
        return open_archive(path)


def write_file(path, tensors: dict, meta: dict) -> None:
    """A safetensors file of `tensors` with `meta` and every tensor's CRC-32, written whole or not
    at all."""
    from safetensors.torch import save

    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}  # a GPU's archive too
    meta = {**meta, "crc32": json.dumps({name: zlib.crc32(_bytes(t)) for name, t in tensors.items()})}
    write_atomic(io.BytesIO(save(tensors, metadata=meta)), Path(path))


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy. A contiguous tensor may still carry any stride on a
    size-1 dimension (one KV head: Gemma 3 270M), which `view(uint8)` refuses: read it as the flat
    run of elements it is."""
    flat = t.contiguous().as_strided((t.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())


def pack(kind: str, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kept: torch.Tensor) -> ArchiveLayer:
    """The entries of one layer a selection did not keep: k, v (B, Hkv, n, D), positions (B, n)
    (-1 = padding), kept (B, Hkv, M) the selected column indices (-1 = none)."""
    B, H, n, _ = k.shape
    valid = (positions >= 0)[:, None].expand(B, H, n)  # (B, Hkv, n)
    keep = torch.zeros(B, H, n + 1, dtype=torch.bool, device=k.device)
    keep.scatter_(2, torch.where(kept >= 0, kept, torch.full_like(kept, n)), True)  # n: a discard slot
    evicted = valid & ~keep[..., :n]  # (B, Hkv, n)
    count = evicted.sum(-1, keepdim=True)  # (B, Hkv, 1)
    A = int(count.max()) if evicted.numel() else 0
    order = evicted.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :A]  # (B, Hkv, A) evicted first
    present = evicted.gather(2, order)  # (B, Hkv, A)
    pos = torch.where(present, positions[:, None].expand(B, H, n).gather(2, order), torch.full_like(order, -1))
    last = torch.minimum(torch.arange(A, device=k.device), (count - 1).clamp_min(0))  # (B, Hkv, A)
    order = order.gather(2, last)  # padding repeats the last evicted entry: no foreign key widens a block's range
    planes = []
    for x, side in ((k, "k"), (v, "v")):
        picked = x.gather(2, order[..., None].expand(B, H, A, x.shape[-1])).permute(2, 0, 1, 3)  # (A, B, Hkv, D)
        planes += [p.contiguous() for p in encode(picked, kind, side)]
    return ArchiveLayer(kind, planes, pos.permute(2, 0, 1).to(torch.int32).contiguous())


def open_archive(path) -> KVArchive:
    """An archive file written by `KVArchive.save`, read layer by layer as questions need it.
    Raises `ArchiveError` for a file that is not one, truncated or corrupt (its CRCs are checked
    at every read of a layer)."""
    path = Path(path)
    meta, tensors = read_file(path, FORMAT, "archive file")
    return from_tensors(path, tensors, meta)


def read_file(path: Path, fmt: str, what: str) -> tuple[dict, "FileTensors"]:
    """(metadata, its tensors, each read when asked for) of a file `write_file` wrote in format
    `fmt`; `ArchiveError` naming `what` for a missing, foreign, truncated or unreadable one."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ArchiveError(f"{what} {path} does not exist; compress the context again")
    try:
        with safe_open(str(path), "pt") as f:  # validates the header against the file's size
            meta, names = f.metadata() or {}, list(f.keys())
        if meta.get("format") != fmt:
            raise ArchiveError(f"{path} is not a structkv {what} of this version ({meta.get('format')!r}, expected "
                               f"{fmt!r}); delete it and compress the context again")
        json.loads(meta["crc32"])
        return meta, FileTensors(path, names)
    except (SafetensorError, KeyError, ValueError, OSError, json.JSONDecodeError) as e:
        if isinstance(e, ArchiveError):
            raise
        raise ArchiveError(f"{what} {path} is corrupt or truncated ({e}); delete it and compress the context "
                           "again") from None


def from_tensors(path: Path, tensors: dict, meta: dict) -> KVArchive:
    """The archive held by a file's mapped `tensors` (named as `KVArchive.tensors` names them) and
    its metadata, each layer's CRCs checked when it is first read (also how a state file holds
    its archive)."""
    try:
        kind, layers, crc = meta["kind"], json.loads(meta["layers"]), json.loads(meta["crc32"])
    except (KeyError, json.JSONDecodeError) as e:
        raise ArchiveError(f"archive file {path} has unreadable metadata ({e}); compress the context again") from None
    check_kind(kind)
    out = {}
    for i in layers:
        keys = [f"{i}.{j}" for j in range(2 * PLANES[kind])] + [f"{i}.pos"]
        missing = [name for name in keys if name not in tensors or name not in crc]
        if missing:
            raise ArchiveError(f"archive file {path} lacks {missing}: corrupt; compress the context again")
        out[i] = ArchiveLayer(kind, None, None, source=(tensors, keys, {name: crc[name] for name in keys}))
    return KVArchive(kind, out, path)


class FileTensors(Mapping):
    """The tensors of a safetensors file (its header validated by `safe_open`), each read from the
    file when asked for (pread into memory of its own). Nothing is mapped, so a file truncated in
    place is a short read (`ArchiveError`), never a SIGBUS; the file is opened at each read, so
    one that was removed or replaced is noticed, and no descriptor is held between questions."""

    def __init__(self, path: Path, names: list[str]):
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        self.path, self.base, self.header = path, 8 + header_len, {name: header[name] for name in names}

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self.header[name]
        start, end = spec["data_offsets"]
        try:
            with self.path.open("rb") as f:
                data = os.pread(f.fileno(), end - start, self.base + start)
        except OSError as e:
            raise ArchiveError(f"archive file {self.path} cannot be read ({e.strerror or e}); compress the context "
                               "again") from None
        if len(data) != end - start:
            raise ArchiveError(f"archive file {self.path} is truncated (tensor {name}: {len(data)} of {end - start} "
                               "bytes); delete it and compress the context again")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return raw.view(DTYPES[spec["dtype"]]).view(spec["shape"])

    def shape(self, name: str) -> list[int]:
        return self.header[name]["shape"]

    def nbytes(self, name: str) -> int:
        start, end = self.header[name]["data_offsets"]
        return end - start

    def __iter__(self):
        return iter(self.header)

    def __len__(self) -> int:
        return len(self.header)


def crc_check(path: Path, named: dict):
    """A check that each (tensor, expected CRC-32) of `named` (name -> pair) still matches."""
    def check():
        for name, (tensor, expected) in named.items():
            if zlib.crc32(_bytes(tensor)) != expected:
                raise ArchiveError(f"archive file {path} is corrupt or was changed (tensor {name} fails its CRC-32); "
                                   "delete it and compress the context again")
    return check
