"""One archived layer ahead: a question reads layer i's archive while layer i+1's is fetched.

A question with recall reads every archived layer's entries once, in layer order. Where they come
from a file (read, then checked against their CRC-32s) that is time the question would otherwise
wait for at each layer. `ArchiveFetch` hands the question each layer on its device and, as it
does, starts reading the next one on one worker thread, so the read and the check overlap the
layer's compute. At most two layers' entries are in memory at once (the one in use and the next),
never the whole archive.

On CUDA the worker also copies the entries into pinned host memory, and the question's thread
copies them to the GPU on a side stream its own stream waits for: the copy is queued behind no
kernel, and the question's kernels queue behind the copy without the host waiting. The stream
part runs only on a GPU (the tests trace it on a CPU-only torch with stand-in streams).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class ArchiveFetch:
    """`take(i)`: archived layer i opened on `device` (`ArchiveError` for a changed file, raised
    here, in the question's thread). Use as a context manager: leaving it waits for the worker."""

    def __init__(self, layers: dict, device):
        self.layers, self.device = layers, torch.device(device)
        self.order = sorted(layers)
        self.pending: dict[int, Future] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="structkv-archive")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._start(0)

    def take(self, i: int):
        future = self.pending.pop(i, None) or self.pool.submit(self._read, i)
        self._start(self.order.index(i) + 1)
        layer = future.result()
        if self.stream is None:
            return layer.to(self.device)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            moved = layer.to(self.device)
        current.wait_stream(self.stream)  # the question's kernels read the entries once copied
        for t in [*moved.planes, moved.pos]:
            t.record_stream(current)  # freed for reuse only after the question's stream is done with them
        return moved

    def _start(self, j: int) -> None:
        if j < len(self.order) and self.order[j] not in self.pending:
            self.pending[self.order[j]] = self.pool.submit(self._read, self.order[j])

    def _read(self, i: int):
        """Layer i in host memory (pinned for a GPU), checked: runs on the worker."""
        layer = self.layers[i].opened()
        return layer if self.stream is None else layer.pinned()

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True)

    def __enter__(self) -> "ArchiveFetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
