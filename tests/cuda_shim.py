"""Run real code as if on a GPU, on this CPU-only torch: `cuda_trace()` makes `device="cuda"`
tensors real CPU tensors that report `cuda:0`, raises on any op that mixes them with a CPU tensor
(as CUDA would) or reaches a `structkv::` kernel that exists only for the CPU, and counts host
reads (`.item()`, `bool()`, `.cpu()`, `nonzero`, a synchronize) and host-to-device copies. The
values are real, so control flow and answers are those of a real run.

Private torch APIs it leans on: `torch.Tensor._make_wrapper_subclass` (a tensor whose reported
device differs from its storage's, as FakeTensor does); a `TorchDispatchMode` in FakeTensorMode's
`_mode_key` slot (so factories skip CUDA's lazy init); `torch._library.custom_ops.OPDEFS` (a
`structkv::` op runs its own Python on the tagged tensors, so the reads inside it are counted) with
`torch._C._EnableTorchFunction` around it. Methods whose Python bindings take a CUDA device guard
before dispatch (`copy_`, `contiguous`, `~`, indexing, `nonzero`, `int()`, `bool()`, moves) are
rerouted in `__torch_function__`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)


class DeviceMismatch(RuntimeError):
    pass


class CpuOnlyOp(RuntimeError):
    """A `structkv::` op with no CUDA kernel (a C++ CPU kernel) was called with cuda:0 tensors."""


@dataclass
class Counts:
    host_reads: list = field(default_factory=list)  # (op name) of every device -> host read
    to_device: int = 0  # host -> device copies
    stream_waits: int = 0  # one stream made to wait for another (`Stream.wait_stream`)

    def mark(self):
        return len(self.host_reads)


_COUNTS: list[Counts] = []  # the active trace's counters (a stack: traces nest)


def _count_read(what: str):
    if _COUNTS:
        _COUNTS[-1].host_reads.append(f"{what} at {_caller()}")


def _caller() -> str:
    """The innermost structkv frame (file:line) that made the read."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if "/structkv/" in frame.filename:
            return f"{frame.filename.split('/structkv/', 1)[1]}:{frame.lineno}"
    return "?"


class OnCuda(torch.Tensor):
    """A CPU tensor `_cpu` that reports device cuda:0."""

    @staticmethod
    def __new__(cls, real: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, real.shape, strides=real.stride(),
                                                   storage_offset=real.storage_offset(), dtype=real.dtype,
                                                   device=CUDA, requires_grad=real.requires_grad)

    def __init__(self, real: torch.Tensor):
        self._cpu = real

    def __repr__(self):
        return f"OnCuda({self._cpu!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES:
            return _move(func, args, kwargs)
        reroute = _REROUTE.get(func)
        if reroute is not None:
            return reroute(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _is_cuda_device(d) -> bool:
    return d is not None and torch.device(d).type == "cuda"


def _dispatch(func, args, kwargs):
    kwargs = dict(kwargs)
    factory_on_cuda = _is_cuda_device(kwargs.get("device"))
    if factory_on_cuda:
        kwargs["device"] = torch.device("cpu")
    if func is aten._local_scalar_dense.default:
        _count_read(func.__name__)
        return func(args[0]._cpu)
    if func is aten._to_copy.default and "device" in kwargs:  # .to(device) / .cpu() / .cuda()
        src_on_cuda = isinstance(args[0], OnCuda)
        out = func(_unwrap(args[0]), **kwargs)
        if src_on_cuda and not factory_on_cuda:
            _count_read(".to(cpu)")
            return out
        if factory_on_cuda and not src_on_cuda and _COUNTS:
            _COUNTS[-1].to_device += 1
        return OnCuda(out) if factory_on_cuda else out
    body = _structkv_op_body(func)
    if body is not None:  # the op's own Python on tagged tensors: its reads and devices are traced too
        with torch._C._EnableTorchFunction(), _Factories():  # dispatch runs with both switched off
            return body(*args, **kwargs)
    tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
    on_cuda = [t for t in tensors if isinstance(t, OnCuda)]
    if on_cuda and func.namespace == "structkv" and not torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CUDA"):
        raise CpuOnlyOp(f"{func.name()} has only a CPU kernel and was called with cuda:0 tensors")
    cpu = [t for t in tensors if not isinstance(t, OnCuda) and t.dim() > 0]  # CUDA accepts CPU scalars
    if on_cuda and cpu:
        raise DeviceMismatch(f"{func}: cuda:0 tensors mixed with CPU tensors of shapes "
                             f"{[tuple(t.shape) for t in cpu]}")
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if not (on_cuda or factory_on_cuda):
        return out
    if func._schema.is_mutable and args and isinstance(args[0], OnCuda) and isinstance(out, torch.Tensor) \
            and out is args[0]._cpu:
        return args[0]  # in place: the same wrapper
    return tree_map(lambda t: OnCuda(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnCuda) else t, out)


def _structkv_op_body(func):
    """The Python function behind a `structkv::` custom op (torch._library.custom_ops.OPDEFS), or
    None for any other op."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func.name().split(".")[0]) if func.namespace == "structkv" else None
    return None if opdef is None else opdef._init_fn


def _unwrap(t):
    return t._cpu if isinstance(t, OnCuda) else t


def _flat(args, kwargs):
    flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    return flat


def _host_scalar(kind):
    def read(self, *a, **k):
        _count_read(kind)
        return getattr(self._cpu, kind)(*a, **k)
    return read


def _index_part(x):
    """An index or value for a cuda:0 tensor: a CPU tensor is copied over, as CUDA does (counted)."""
    if isinstance(x, OnCuda):
        return x._cpu
    if isinstance(x, torch.Tensor) and x.dim() > 0 and _COUNTS:
        _COUNTS[-1].to_device += 1
    return x


def _parts(index):
    return tuple(_index_part(i) for i in index) if isinstance(index, tuple) else _index_part(index)


def _getitem(self, index):
    return OnCuda(self._cpu[_parts(index)])


def _setitem(self, index, value):
    self._cpu[_parts(index)] = _index_part(value)


def _nonzero(self, *, as_tuple=False):
    _count_read("nonzero")  # its output's size is data: CUDA syncs to learn it
    out = aten.nonzero.default(self)
    return out.unbind(1) if as_tuple else out


_REROUTE = {
    torch.Tensor.nonzero: _nonzero,
    torch.nonzero: _nonzero,
    torch.Tensor.copy_: lambda self, src, non_blocking=False: aten.copy_.default(self, src, non_blocking),
    torch.Tensor.contiguous: lambda self, memory_format=torch.contiguous_format: (
        self if self.is_contiguous(memory_format=memory_format)
        else aten.clone.default(self, memory_format=memory_format)),
    torch.Tensor.__invert__: lambda self: aten.bitwise_not.default(self),
    torch.Tensor.__getitem__: _getitem,
    torch.Tensor.__setitem__: _setitem,
    torch.Tensor.__int__: _host_scalar("__int__"),
    torch.Tensor.__bool__: _host_scalar("__bool__"),
    torch.Tensor.__float__: _host_scalar("__float__"),
    torch.Tensor.__index__: _host_scalar("__index__"),
    torch.Tensor.item: _host_scalar("item"),
    torch.Tensor.tolist: _host_scalar("tolist"),
    torch.Tensor.numpy: _host_scalar("numpy"),
}


_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.tensor, torch.as_tensor)


def _target(func, args, kwargs):
    """Where a move sends its tensor: "cuda", "cpu" or None (same device)."""
    if func is torch.Tensor.cuda:
        return "cuda"
    if func is torch.Tensor.cpu:
        return "cpu"
    for a in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(a, OnCuda):
            return "cuda"
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type
    return None


def _move(func, args, kwargs):
    """`.to(...)`, `.cuda()`, `.cpu()`, `torch.tensor(..., device=...)` on the CPU tensors, then tagged."""
    target = _target(func, args, kwargs)
    src = args[0]
    on_cuda = isinstance(src, OnCuda)
    cpu_args = [(a._cpu if isinstance(a, OnCuda) else a) for a in args]
    cpu_args = [("cpu" if isinstance(a, (str, torch.device)) and torch.device(a).type == "cuda" else a)
                for a in cpu_args]
    cpu_kwargs = {k: ("cpu" if k == "device" and _is_cuda_device(v) else v) for k, v in kwargs.items()}
    if func is torch.Tensor.cuda:
        func, cpu_args, cpu_kwargs = torch.Tensor.to, [cpu_args[0], "cpu"], {}
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*cpu_args, **cpu_kwargs)
    if target == "cuda" or (target is None and on_cuda):
        if not on_cuda and _COUNTS:
            _COUNTS[-1].to_device += 1
        return out if isinstance(out, OnCuda) else OnCuda(out)
    if on_cuda:
        _count_read(".to(cpu)")
    return out


class _Methods(torch.overrides.TorchFunctionMode):
    """Moves of plain CPU tensors to "cuda" (their Python bindings would initialise CUDA)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES and _target(func, args, kwargs) == "cuda" or (
                func in _MOVES and any(isinstance(a, OnCuda) for a in args)):
            return _move(func, args, kwargs)
        return func(*args, **kwargs)


class _Factories(TorchDispatchMode):
    """Catches `torch.empty(..., device="cuda")` and the like, which have no tensor argument. It
    takes FakeTensorMode's slot (`_mode_key`), the one that stops factories from initialising CUDA."""

    def __init__(self):
        super().__init__()
        self._mode_key = torch._C._TorchDispatchModeKey.FAKE

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, OnCuda) for t in types) or _is_cuda_device(kwargs.get("device")):
            return _dispatch(func, args, kwargs)
        return func(*args, **kwargs)


class _H100:
    name, multi_processor_count, total_memory, major, minor = "H100 (traced)", 132, 80 << 30, 9, 0


class _Stream:
    """A CUDA stream as the trace sees it: work is in order on the host, so waits are no-ops; a
    synchronize is a host read."""

    def __init__(self, device=None, priority=0):
        self.device = torch.device(device or CUDA)

    def wait_stream(self, other) -> None:
        if not isinstance(other, _Stream):
            raise DeviceMismatch(f"wait_stream on {type(other).__name__}")
        if _COUNTS:
            _COUNTS[-1].stream_waits += 1

    def synchronize(self) -> None:
        _count_read("Stream.synchronize")


def _runtime_stand_ins(counts: Counts) -> dict:
    """`torch.cuda` functions the code may call, answering as one H100 would; a synchronize is a
    host read. Streams are `_Stream`s and `torch.cuda.stream(s)` selects nothing."""
    return {"is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: 1,
            "current_device": lambda: 0, "get_device_properties": lambda *a: _H100(),
            "get_device_name": lambda *a: _H100.name,
            "synchronize": lambda *a: _count_read("torch.cuda.synchronize"),
            "Stream": _Stream, "current_stream": lambda *a: _Stream(), "stream": _select_stream}


def _select_stream(stream):
    if not isinstance(stream, _Stream):
        raise DeviceMismatch(f"torch.cuda.stream({type(stream).__name__})")
    return contextlib.nullcontext()


def _record_stream(self, stream) -> None:
    """`Tensor.record_stream`, which parses its stream before any mode sees it: a CUDA tensor's only."""
    if not isinstance(self, OnCuda) or not isinstance(stream, _Stream):
        raise DeviceMismatch(f"record_stream on a {self.device} tensor with {type(stream).__name__}")


def _pin_memory(self, *args, **kwargs):
    """`Tensor.pin_memory` on a CPU-only torch: host memory as it is (a CUDA tensor cannot be pinned)."""
    if self.device.type != "cpu":
        raise DeviceMismatch(f"pin_memory of a {self.device} tensor")
    return self


@contextlib.contextmanager
def cuda_trace():
    """Within: `device="cuda"` is a tagged CPU tensor and `torch.cuda` answers as one H100;
    yields the Counts of host reads."""
    counts = Counts()
    _COUNTS.append(counts)
    saved = {name: getattr(torch.cuda, name) for name in _runtime_stand_ins(counts)}
    # patched on the class: worker threads pin too (modes are per thread); record_stream's binding
    # parses its stream argument before any mode sees the call
    methods = {"pin_memory": _pin_memory, "record_stream": _record_stream}
    saved_methods = {name: getattr(torch.Tensor, name) for name in methods}
    try:
        for name, fn in _runtime_stand_ins(counts).items():
            setattr(torch.cuda, name, fn)
        for name, fn in methods.items():
            setattr(torch.Tensor, name, fn)
        with _Factories(), _Methods():
            yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        for name, fn in saved_methods.items():
            setattr(torch.Tensor, name, fn)
        _COUNTS.pop()


def on_cuda(t: torch.Tensor) -> OnCuda:
    return OnCuda(t)
