"""The tensor-parallel group a model runs in: its rank, size and the collectives the decoder and the
compression methods use. One object per model (no module-level state)."""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

DEFAULT_TIMEOUT_S = 300  # a rank that died makes the others fail after this long instead of hanging


@dataclass(frozen=True)
class TensorParallel:
    group: object  # a torch.distributed ProcessGroup
    rank: int
    world: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (traceable: stays inside a compiled graph)."""
        return _waited(funcol.all_reduce(x, "sum", self.group))

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H_local, ...) -> (B, H_local * world, ...): every rank's heads, in rank order."""
        stacked = funcol.all_gather_single(x.transpose(0, 1).contiguous(), 0, self.group)  # (world*H_local, B, ...)
        return _waited(stacked).transpose(0, 1)

    def heads(self, local: int) -> slice:
        """This rank's slice of `local * world` heads."""
        return slice(self.rank * local, (self.rank + 1) * local)


def _waited(x: torch.Tensor) -> torch.Tensor:
    """Eager: wait for the collective now (its result is used at once anyway); compiled graphs
    place the wait themselves."""
    return x if torch.compiler.is_compiling() else funcol.wait_tensor(x)


def _leave() -> None:
    """At exit, leave the group together: a rank that exits while its peer's gloo threads still
    talk to it aborts the peer ("terminate called without an active exception", SIGABRT), which
    a loaded machine made frequent."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a command-line process that ran tensor-parallel: flush its output, leave the group
    together, then exit without the interpreter's teardown. Leaving at `atexit` was not enough on
    a loaded machine: gloo's threads, destroyed with the C++ statics after the group was left,
    still aborted a rank now and then ("terminate called without an active exception", SIGABRT,
    after its answer was printed); `os._exit` skips those destructors. For the CLI only: a library
    caller keeps its process."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    _leave()
    os._exit(code)


def init(tp: int, *, timeout_s: float | None = None) -> TensorParallel:
    """Join (or start, from torchrun's environment) the default process group of `tp` ranks.

    Backend: NCCL on CUDA, gloo on CPU. Only pure tensor parallelism: the world is the TP group.
    Collectives time out after `timeout_s` (env STRUCTKV_TP_TIMEOUT, default 300 s), so a rank
    that fails ends the run with an error on the others instead of a hang."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(f"tp={tp} needs {tp} processes: launch with `torchrun --nproc-per-node {tp} ...` "
                               "(or call torch.distributed.init_process_group first)")
        timeout = timeout_s or float(os.environ.get("STRUCTKV_TP_TIMEOUT", DEFAULT_TIMEOUT_S))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        atexit.register(_leave)  # we started the group: we end it
    world = dist.get_world_size()
    if world != tp:
        raise ValueError(f"tp={tp} but {world} processes were launched; use torchrun --nproc-per-node {tp}")
    return TensorParallel(dist.group.WORLD, dist.get_rank(), world)
