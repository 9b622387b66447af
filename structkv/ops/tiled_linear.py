"""`structkv::int4_tiled_linear`, `structkv::int8_tiled_linear`: x (M, K) times a 4- or 8-bit
weight stored in tiles of 16 output rows (csrc/tiled_linear.cpp) -> (M, N) float32; the products
`weights="int4" | "int8"` run on a CPU where it builds.

Why its own kernels: PyTorch's packed int4 kernel (`aten._weight_int4pack_mm_for_cpu`) reads one
output row at a time and takes bf16 activations; on decode's short rows (K 576-1536) it reached
0.56-0.68 of the float32 path's GB/s on an AVX-512 machine and 0.3 on an AVX2 one, and the int8
reduction inductor compiles for the decode step 0.15 there, where llama.cpp multiplies its codes
by int8 activations. These kernels do the same: x quantized per group of 32 to int8 (symmetric, one
float scale a group), the codes multiplied as integers 16 rows at a time (VPDPBUSD on AVX-512 VNNI,
VPMADDUBSW on AVX2), the float scales applied once per group (research/benchmarks_log.md has the
measurements). A prompt (M >= `dense_rows`) unpacks the weight 4096 rows at a time and runs GEMMs
on the unquantized x: in bf16 where the CPU multiplies bf16 natively (AVX512_BF16, AMX), else in
float32 (a bf16 GEMM without them ran 7x slower than float32, measured on an AVX2 machine).

int4 (`pack_int4`): codes (N/16, K/8, 64) uint8, per tile and step of 8 columns byte 4i + j =
row i's column j (low nibble) and column 4 + j (high nibble); float16 scale and minimum
(N/16, K/32, 16), w = code * scale + min (GGUF's Q4_1: a Q4_1 block's d and m are float16 too).
int8 (`pack_int8`): codes (N/16, K/4, 64) int8, byte 4i + j of a step = row i's column j, and the
per-row bf16 scales (N,) of `weights="int8"`, w = code * scale.

The C++ source is built on first use against this torch's headers (about a minute, once per
machine: `structkv.ops.building`), loaded into the dispatcher (a call costs ~2 us from a compiled
graph, where a Python custom op costs ~10), and `available()` says whether it built with a vector
path; where it did not, `weights="int4"` keeps PyTorch's packed kernel.
`STRUCTKV_CPU_KERNELS=0` turns it off.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .building import native_library, torch_extension_flags

SOURCE = Path(__file__).parent / "csrc" / "tiled_linear.cpp"
GROUP, ROWS, STEP = 32, 16, 8  # columns a group, rows a tile, int4 columns a step (csrc: kGroup, kRows, kStep)
FAST = ("avx512_vnni", "avx2")  # the vector paths; "portable" is correct but slower than the packed kernel

_LIB_SCHEMAS = ("int4_tiled_linear(Tensor x, Tensor codes, Tensor scale, Tensor lo, int dense_rows) -> Tensor",
                "int4_tiled_weight(Tensor codes, Tensor scale, Tensor lo) -> Tensor",
                "int8_tiled_linear(Tensor x, Tensor codes, Tensor scales, int dense_rows) -> Tensor",
                "int8_tiled_weight(Tensor codes, Tensor scales) -> Tensor")
_LIB = torch.library.Library("structkv", "FRAGMENT")
for _schema in _LIB_SCHEMAS:
    _LIB.define(_schema)


@torch.library.register_fake("structkv::int4_tiled_linear", lib=_LIB)
def _(x, codes, scale, lo, dense_rows):
    return x.new_empty(x.shape[0], codes.shape[0] * ROWS, dtype=torch.float32)


@torch.library.register_fake("structkv::int4_tiled_weight", lib=_LIB)
def _(codes, scale, lo):
    return codes.new_empty(codes.shape[0] * ROWS, codes.shape[1] * STEP, dtype=torch.float32)


@torch.library.register_fake("structkv::int8_tiled_linear", lib=_LIB)
def _(x, codes, scales, dense_rows):
    return x.new_empty(x.shape[0], codes.shape[0] * ROWS, dtype=torch.float32)


@torch.library.register_fake("structkv::int8_tiled_weight", lib=_LIB)
def _(codes, scales):
    return codes.new_empty(codes.shape[0] * ROWS, codes.shape[1] * 4, dtype=torch.float32)


def _build(source: Path, extra_flags: list[str] = ()) -> tuple[Path | None, str]:
    """The shared library of `source` built as the library builds its own, `extra_flags` appended."""
    flags, libs = torch_extension_flags()
    return native_library(source, "CXX", ("c++", "g++", "clang++"), [*flags, *extra_flags], libs,
                          salt=torch.__version__, what="the tiled int4 / int8 kernels")


def _load_isa(lib: Path, symbol: str) -> str:
    """Load `lib`'s ops into the dispatcher; the path it compiled, as its exported `symbol` names it."""
    torch.ops.load_library(str(lib))
    isa = getattr(ctypes.CDLL(str(lib)), symbol)
    isa.restype = ctypes.c_char_p
    return isa().decode()


@functools.cache
def _load() -> tuple[str | None, str]:
    """(the instruction set the build compiled for, "") or (None, why not)."""
    lib, why = _build(SOURCE)
    if lib is None:
        return None, why
    try:
        return _load_isa(lib, "structkv_tiled_linear_isa"), ""
    except (OSError, RuntimeError, AttributeError) as e:
        return None, f"the tiled int4 / int8 kernels could not be loaded: {e}"


def build_variant(namespace: str, extra_flags: list[str] = (), source: Path = SOURCE):
    """`source` built again with `extra_flags` appended (`-mno-avx512f`: the AVX2 path on an AVX-512
    CPU; `-mno-avx512f -mno-avx2 -mno-fma -mno-f16c`: the portable one) and its ops registered under
    `namespace` instead of `structkv`, beside the library's own build. Why: a machine runs one path by
    default; the tests check the others against the same references there, and benchmarks alternate
    builds of the kernel in one process. Returns (the torch.library.Library holding the schemas: keep
    it alive while the ops are used, the path the build compiled). Raises RuntimeError when it fails."""
    import tempfile

    text = source.read_text().replace("TORCH_LIBRARY_IMPL(structkv,", f"TORCH_LIBRARY_IMPL({namespace},")
    text = text.replace("structkv_tiled_linear_isa", f"{namespace}_isa")  # one exported name per build
    with tempfile.TemporaryDirectory() as tmp:  # the renamed source; the build is cached by its text
        renamed = Path(tmp) / f"{source.stem}_{namespace}.cpp"
        renamed.write_text(text)
        lib_path, why = _build(renamed, extra_flags)
    if lib_path is None:
        raise RuntimeError(why)
    lib = torch.library.Library(namespace, "DEF")
    for schema in _LIB_SCHEMAS:
        lib.define(schema)
    return lib, _load_isa(lib_path, f"{namespace}_isa")


def loaded() -> bool:
    """Whether the op runs here (any path, the portable one included: the tests use it)."""
    return _load()[0] is not None


def available() -> bool:
    """Whether the ops run here on a vector path (what `weights="int4" | "int8"` use them for)."""
    return _load()[0] in FAST


def isa() -> str | None:
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1] or (f"built without a vector path ({isa()})" if not available() else "")


def fits(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % GROUP == 0


def _check_fits(N: int, K: int) -> None:
    if not fits(N, K):
        raise ValueError(f"tiled weights need out_features % {ROWS} == 0 and in_features % {GROUP} == 0, "
                         f"got ({N}, {K})")


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight (N, K) -> codes (N, K) uint8 in 0..15 and float16 scale, minimum (N, K/32):
    per group of 32 columns the range split into 15 steps, the codes rounded against the stored
    (float16) scale and minimum, so w ~ code * scale + min with an error of half a step."""
    N, K = w.shape
    if not w.isfinite().all() or w.abs().max() > torch.finfo(torch.float16).max / 2:
        raise ValueError("int4 weights need finite values within float16's range; use weights='int8'")
    groups = w.float().view(N, K // GROUP, GROUP)  # (N, G, 32)
    low, high = groups.amin(-1), groups.amax(-1)  # (N, G)
    lo = low.to(torch.float16)
    scale = ((high - lo.float()) / 15).clamp(min=2**-24).to(torch.float16)  # float16's smallest step
    codes = torch.round((groups - lo.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).view(N, K), scale, lo


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor):
    """codes (N, K) 0..15 and tables (N, K/32) -> the kernel's (N/16, K/8, 64) codes and
    (N/16, K/32, 16) float16 tables."""
    N, K = codes.shape
    _check_fits(N, K)
    c = codes.to(torch.uint8).view(N // ROWS, ROWS, K // STEP, 2, 4)  # (T, 16 rows, K/8 steps, low|high, 4)
    c = c.permute(0, 2, 1, 4, 3)  # (T, K/8, 16, 4, 2): a step's 64 bytes, row-major over (row, column)
    tiled = (c[..., 0] | (c[..., 1] << 4)).reshape(N // ROWS, K // STEP, 64).contiguous()
    table = [t.to(torch.float16).view(N // ROWS, ROWS, K // GROUP).transpose(1, 2).contiguous()  # (T, G, 16)
             for t in (scale, lo)]
    return tiled, *table


def unpack_int4(tiled: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse for the codes: (N/16, K/8, 64) -> (N, K) uint8."""
    T, S, _ = tiled.shape
    b = tiled.view(T, S, ROWS, 4)  # (T, K/8, 16, 4)
    c = torch.stack([b & 15, b >> 4], -2)  # (T, K/8, 16, 2, 4): columns 0-3 low, 4-7 high
    return c.permute(0, 2, 1, 3, 4).reshape(T * ROWS, S * STEP)


def int4_weight(tiled: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 weight (N, K) of a tiled int4 layout, in plain PyTorch (the reference)."""
    codes = unpack_int4(tiled).float()
    N, K = codes.shape
    per_row = [t.float().transpose(1, 2).reshape(N, K // GROUP, 1) for t in (scale, lo)]  # (T, G, 16) -> (N, G, 1)
    return (codes.view(N, K // GROUP, GROUP) * per_row[0] + per_row[1]).view(N, K)


def quantize_activations(x: torch.Tensor):
    """x (M, K) float -> int8 codes (M, K), per group scale (M, K/32) and sum of x as quantized
    (M, K/32): the kernel's arithmetic (scale = max|x| / 127, 1 for a zero group; ties to even)."""
    M, K = x.shape
    g = x.float().view(M, K // GROUP, GROUP)
    amax = g.abs().amax(-1)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(g / s[..., None])
    return q.to(torch.int8).view(M, K), s, s * q.sum(-1)


def _group_products(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Each group's integer product of x's codes q (M, K) and the weight's codes (N, K) -> (M, N, K/32),
    exact in float64."""
    M, K = q.shape
    G = K // GROUP
    return torch.einsum("mgj,ngj->mng", q.double().view(M, G, GROUP), codes.double().view(-1, G, GROUP))


def reference_int4(x: torch.Tensor, tiled: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """What `int4_tiled_linear` computes for few rows, in plain PyTorch (tests): x quantized per
    group, integer products per group, then the float scale and minimum."""
    q, xs, xsum = quantize_activations(x)
    isum = _group_products(q, unpack_int4(tiled))  # (M, N, G)
    N, G = isum.shape[1:]
    s, m = (t.double().transpose(1, 2).reshape(N, G) for t in (scale, lo))  # (T, G, 16) -> (N, G)
    out = isum * s[None] * xs.double()[:, None] + m[None] * xsum.double()[:, None]  # (M, N, G)
    return out.sum(-1).float()


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes (N, K) -> the kernel's (N/16, K/4, 64): per tile and step of 4 columns, row-major
    over (row, column)."""
    N, K = codes.shape
    _check_fits(N, K)
    c = codes.to(torch.int8).view(N // ROWS, ROWS, K // 4, 4).transpose(1, 2)  # (T, K/4, 16, 4)
    return c.reshape(N // ROWS, K // 4, 64).contiguous()


def unpack_int8(tiled: torch.Tensor) -> torch.Tensor:
    """`pack_int8`'s inverse: (N/16, K/4, 64) -> (N, K) int8."""
    T, S, _ = tiled.shape
    return tiled.view(T, S, ROWS, 4).transpose(1, 2).reshape(T * ROWS, S * 4)


def int8_rows(tiled: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (...,) of the codes (..., K) int8, read in place (an embedding lookup from the
    tied LM head's tiles): row n is bytes 4 (n % 16) .. + 4 of every step of tile n // 16."""
    T, S, _ = tiled.shape
    steps = tiled.view(T, S, ROWS, 4)[index // ROWS, :, index % ROWS]  # (..., K/4, 4)
    return steps.reshape(*index.shape, S * 4)


def reference_int8(x: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What `int8_tiled_linear` computes for few rows, in plain PyTorch (tests)."""
    q, xs, _ = quantize_activations(x)
    isum = _group_products(q, unpack_int8(tiled))  # (M, N, G)
    return ((isum * xs.double()[:, None]).sum(-1) * scales.double()[None]).float()


def int4_tiled_linear(x: torch.Tensor, tiled: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                      dense_rows: int) -> torch.Tensor:
    """x (M, K) float32 or bf16 -> (M, N) float32; M >= dense_rows runs GEMMs on the unquantized x."""
    return torch.ops.structkv.int4_tiled_linear(x, tiled, scale, lo, dense_rows)


def int8_tiled_linear(x: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor, dense_rows: int) -> torch.Tensor:
    """x (M, K) float32 or bf16 -> (M, N) float32; M >= dense_rows runs GEMMs on the unquantized x."""
    return torch.ops.structkv.int8_tiled_linear(x, tiled, scales, dense_rows)
