"""Compressed contexts kept between requests: compress a document once, answer many questions.

Prefix caching as vLLM does it reuses the KV entries of a shared prefix; a compressed cache cannot
be shared that way, because what a method keeps depends on the whole context it compressed (and
on the method and its budgets). So the unit cached here is a whole `CompressedState`, keyed by
(method, options, the context's token ids) and reused only for exactly that context. Least
recently used states are dropped first so that the buffers held stay under a byte bound.

With ask-time recall a state also holds an archive of what its method evicted: in RAM it counts
towards the bound; in a file (`structkv serve --archive-dir`) it does not (it is on disk, read by
each question through a memory map), and the state's file lets a restarted server answer without
compressing the document again. `split` counts hot sets and archives apart.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from threading import Lock


def context_key(method_key: tuple, token_ids: list[int]) -> tuple:
    """The cache key of a context: (model, method, options...) and a digest of the token ids."""
    digest = hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()
    return (*method_key, len(token_ids), digest)


def state_bytes(state) -> int:
    """Bytes a state holds in RAM: its hot set's buffers as allocated (kept entries + room), its
    logits, and its archive when the archive is in memory (an archive in a file is on disk)."""
    return hot_bytes(state) + (archive_bytes(state) if not on_disk(state) else 0)


def hot_bytes(state) -> int:
    return sum(state.cache.nbytes(used=False)) + state.logits.numel() * state.logits.element_size()


def archive_bytes(state) -> int:
    return state.archive.nbytes() if state.archive is not None else 0


def on_disk(state) -> bool:
    return state.archive is not None and state.archive.path is not None


class ContextCache:
    """An LRU map key -> CompressedState bounded by `max_bytes` (0 disables caching)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the context cache bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._states: OrderedDict = OrderedDict()
        self._bytes: dict = {}
        self._lock = Lock()  # /metrics reads the totals from the event loop while the worker writes
        self.hits = self.misses = self.evictions = self.oversized = 0  # oversized: alone over the bound

    def get(self, key, room: int = 0):
        """The state under `key` if it has `room` free cache slots for what is appended, else None
        (a miss: the caller compresses again with more room and replaces it)."""
        with self._lock:
            state = self._states.get(key)
            if state is None or state.cache.free() < room:
                self.misses += 1
                return None
            self._states.move_to_end(key)
            self.hits += 1
            return state

    def put(self, key, state) -> bool:
        """Keep `state` (replacing one under the same key), dropping the least recently used ones
        until it fits; False when it alone is over the bound (it is not kept)."""
        size = state_bytes(state)
        with self._lock:
            self._drop(key)
            if size > self.max_bytes:
                self.oversized += 1
                return False
            while self._states and self.nbytes + size > self.max_bytes:
                self._drop(next(iter(self._states)))
                self.evictions += 1
            self._states[key], self._bytes[key] = state, size
            return True

    def discard(self, key) -> None:
        """Forget the state under `key` (e.g. its file turned out damaged)."""
        with self._lock:
            self._drop(key)

    def _drop(self, key) -> None:
        self._states.pop(key, None)
        self._bytes.pop(key, None)

    @property
    def nbytes(self) -> int:
        return sum(list(self._bytes.values()))  # list(): one atomic copy while another thread writes

    def split(self) -> dict:
        """The bound's use counted apart: hot sets in RAM, archives in RAM, archives in files."""
        with self._lock:
            states = list(self._states.values())
        return {"hot_bytes": sum(map(hot_bytes, states)),
                "archive_ram_bytes": sum(archive_bytes(s) for s in states if not on_disk(s)),
                "archive_disk_bytes": sum(archive_bytes(s) for s in states if on_disk(s))}

    def __len__(self) -> int:
        return len(self._states)
