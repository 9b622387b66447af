"""structkv's tiled int4 / int8 kernels (`structkv::int4_tiled_linear`, `structkv::int8_tiled_linear`,
C++ built on first use) against plain-PyTorch references of the same arithmetic (hypothesis over
shapes and rows; on every vector path this CPU runs, the AVX2 and scalar ones built again on an
AVX-512 machine), their error against the float product bounded by the activations' rounding, the
layouts' round trips and row lookup, GGUF Q4_1 blocks kept exactly, the ops' registration
(opcheck), clear errors on bad input, generation on either layout, and the fallback to PyTorch's
packed kernels where they do not build."""
import functools
import platform

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import structkv
from structkv.models.quantized import QuantizedLinear
from structkv.ops import tiled_linear as T

pytestmark = pytest.mark.skipif(not T.loaded(), reason=f"no tiled kernels: {T.unavailable_reason()}")


def weight_of(N, K, seed, spread=0.02):
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * spread


def int4_of(w):
    return T.pack_int4(*T.quantize_int4(w))


def int8_of(w):
    lin = QuantizedLinear.from_weight(w, "int8", layout="tiled")
    return lin.tiles, lin.scales


def run(kind, x, stored, dense_rows=128, namespace="structkv"):
    ops = getattr(torch.ops, namespace)
    op = ops.int4_tiled_linear if kind == "int4" else ops.int8_tiled_linear
    return op(x, *stored, dense_rows)


OTHER_PATHS = {"avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"]}


@functools.cache
def build_of(path):
    """(namespace, library) of the ops running `path`: "native" is the library's own build; "avx2" and
    "portable" the same source built again for them (`build_variant`) where this CPU runs them, so an
    AVX-512 machine checks the AVX2 and scalar code it never runs by default."""
    if path == "native":
        return "structkv", None
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the {path} path is built by x86 flags")
    if path == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    lib, isa = T.build_variant(f"structkv_{path}_path", OTHER_PATHS[path])
    assert isa == path, f"{OTHER_PATHS[path]} built the {isa} path"
    return f"structkv_{path}_path", lib


PATHS = pytest.mark.parametrize("path", ["native", "avx2", "portable"])


def reference(kind, x, stored):
    return (T.reference_int4 if kind == "int4" else T.reference_int8)(x, *stored)


def stored_weight(kind, stored):
    return T.int4_weight(*stored) if kind == "int4" else T.unpack_int8(stored[0]).float() * stored[1].float()[:, None]


@PATHS
@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["int4", "int8"]), tiles=st.integers(1, 6), groups=st.integers(1, 8),
       rows=st.integers(1, 6), seed=st.integers(0, 2**16), spread=st.sampled_from([1e-3, 0.02, 3.0]))
def test_kernel_equals_the_reference_of_its_arithmetic(path, kind, tiles, groups, rows, seed, spread):
    """Few rows: the same integer products and float scales as the reference, up to float32 sums, on
    every vector path this CPU runs."""
    N, K = 16 * tiles, 32 * groups
    stored = (int4_of if kind == "int4" else int8_of)(weight_of(N, K, seed, spread))
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed + 1)) * spread
    out, ref = run(kind, x, stored, namespace=build_of(path)[0]), reference(kind, x, stored)
    assert out.shape == (rows, N) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=float(ref.abs().max()) * 1e-5 + 1e-30)


@PATHS
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_activations_round_as_the_reference_at_ties_and_zero_groups(path, kind):
    """The vectorised quantization of x (AVX-512 / AVX2 / scalar, each path this CPU runs) gives the
    reference's codes where rounding is decided by ties to even, in an all-zero group (scale 1) and
    at the group's extremes, in a second row too: any code off by one would move an output by a
    whole step of the weight."""
    N, K = 32, 96
    stored = (int4_of if kind == "int4" else int8_of)(weight_of(N, K, 7))
    ties = torch.tensor([127.0, -127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5] + [3.0] * 22)
    x = torch.stack([torch.cat([torch.zeros(32), ties, -ties.flip(0)]), torch.cat([ties, torch.zeros(32), ties])])
    codes, scale, _ = T.quantize_activations(x)
    assert torch.equal(codes[0, 32:42], torch.tensor([127, -127, 0, 2, 2, 0, -2, -2, 126, -126], dtype=torch.int8))
    assert torch.equal(scale[0, 0], torch.tensor(1.0))  # the zero group's scale
    out, ref = run(kind, x, stored, namespace=build_of(path)[0]), reference(kind, x, stored)
    torch.testing.assert_close(out, ref, rtol=0, atol=float(ref.abs().max()) * 1e-6)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["int4", "int8"]), tiles=st.integers(1, 4), groups=st.integers(1, 6),
       rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_error_against_the_float_product_is_the_activations_rounding(kind, tiles, groups, rows, seed):
    """x is rounded per group of 32 to int8: each output is within sum |w| * (x's step / 2) of the
    float product of the same stored weight, and (int4) the stored weight within half a code step."""
    N, K = 16 * tiles, 32 * groups
    w = weight_of(N, K, seed)
    stored = (int4_of if kind == "int4" else int8_of)(w)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed + 1))
    wq = stored_weight(kind, stored)
    out, exact = run(kind, x, stored), x @ wq.t()
    step = x.view(rows, -1, 32).abs().amax(-1).repeat_interleave(32, 1) / 127  # (M, K): each x's rounding step
    bound = (step / 2) @ wq.abs().t()  # (M, N)
    assert ((out - exact).abs() <= bound * 1.001 + exact.abs() * 1e-5).all()
    if kind == "int4":
        group_step = (w.view(N, -1, 32).amax(-1) - w.view(N, -1, 32).amin(-1)).repeat_interleave(32, 1) / 15
        assert ((wq - w).abs() <= group_step * 0.51 + w.abs() * 2**-10).all()


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_many_rows_run_the_gemm_and_every_count_passes_opcheck(kind, rows):
    """At `dense_rows` and above the op unpacks the weight and runs a GEMM on the unquantized x (bf16
    or float32: within bf16's rounding of the float product)."""
    stored = (int4_of if kind == "int4" else int8_of)(weight_of(48, 96, 3))
    x = torch.randn(rows, 96)
    linear = torch.ops.structkv.int4_tiled_linear if kind == "int4" else torch.ops.structkv.int8_tiled_linear
    weight = torch.ops.structkv.int4_tiled_weight if kind == "int4" else torch.ops.structkv.int8_tiled_weight
    torch.library.opcheck(linear.default, (x, *stored, 128))
    torch.library.opcheck(weight.default, stored)
    torch.testing.assert_close(weight(*stored), stored_weight(kind, stored), rtol=2**-22, atol=1e-7)  # C++ = Python
    want = F.linear(x.to(torch.bfloat16), stored_weight(kind, stored).to(torch.bfloat16)).float()
    torch.testing.assert_close(run(kind, x, stored, dense_rows=1), want, rtol=0, atol=float(want.abs().max()) * 2**-7)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_threads_split_large_weights_and_agree_with_one(kind):
    """A weight past the per-thread minimum (256 KB) is split over threads; every tile's outputs
    are computed the same way, so 1 and 2 threads agree bit for bit, and with the reference."""
    stored = (int4_of if kind == "int4" else int8_of)(weight_of(1024, 1024, 7))
    x = torch.randn(3, 1024)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(run(kind, x, stored))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    ref = reference(kind, x, stored)
    torch.testing.assert_close(outs[1], ref, rtol=0, atol=float(ref.abs().max()) * 1e-5)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_prompt_over_a_tall_weight_runs_in_blocks_of_rows(kind):
    """More than 4096 rows (the LM head's shape): the GEMM path unpacks blocks of rows; every
    block's outputs land in their columns."""
    stored = (int4_of if kind == "int4" else int8_of)(weight_of(16 * 300, 32, 6))
    x = torch.randn(130, 32)
    want = x @ stored_weight(kind, stored).t()
    torch.testing.assert_close(run(kind, x, stored), want, rtol=0, atol=float(want.abs().max()) * 2**-7)


@settings(max_examples=20, deadline=None)
@given(tiles=st.integers(1, 4), groups=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_layouts_round_trip_and_rows_are_read_in_place(tiles, groups, seed):
    N, K = 16 * tiles, 32 * groups
    g = torch.Generator().manual_seed(seed)
    codes4 = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scale, lo = torch.rand(N, K // 32).to(torch.float16), (torch.randn(N, K // 32) * 0.1).to(torch.float16)
    t = T.pack_int4(codes4, scale, lo)
    assert torch.equal(T.unpack_int4(t[0]), codes4)
    torch.testing.assert_close(torch.ops.structkv.int4_tiled_weight(*t), T.int4_weight(*t), rtol=2**-22, atol=1e-7)
    codes8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    t8 = T.pack_int8(codes8)
    assert torch.equal(T.unpack_int8(t8), codes8)
    index = torch.randint(0, N, (3, 5), generator=g)
    assert torch.equal(T.int8_rows(t8, index), codes8[index])


def test_int8_tiled_keeps_the_packed_codes_and_its_rows():
    """The same codes and scales as the packed int8 layout, so the tied embedding reads the same rows."""
    w = weight_of(64, 96, 4)
    tiled, packed = (QuantizedLinear.from_weight(w, "int8", layout=lay) for lay in ("tiled", "packed"))
    assert torch.equal(T.unpack_int8(tiled.tiles), packed.codes) and torch.equal(tiled.scales, packed.scales)
    index = torch.tensor([[0, 17], [63, 5]])
    assert torch.equal(tiled.rows(index), packed.rows(index)) and torch.equal(tiled.dequantize(), packed.dequantize())


def test_q4_1_blocks_are_kept_exactly():
    """A GGUF Q4_1 block (w = d * q + m, d and m float16, q spanning 0..15) comes back as the same
    codes and the same d and m."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (32, 3, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(32, 3, 1, generator=g) * 0.01 + 0.001).to(torch.float16).float()
    m = (-8 * d + torch.randn(32, 3, 1, generator=g) * 1e-3).to(torch.float16).float()
    codes, scale, lo = T.quantize_int4((m + d * q).view(32, 96))
    assert torch.equal(codes.view(32, 3, 32).float(), q)
    assert torch.equal(scale.float(), d[..., 0]) and torch.equal(lo.float(), m[..., 0])


def test_bad_input_is_refused_clearly():
    tiles, scale, lo = int4_of(weight_of(32, 64, 0))
    with pytest.raises(RuntimeError, match=r"x must be \(M, 64\)"):
        torch.ops.structkv.int4_tiled_linear(torch.randn(1, 32), tiles, scale, lo, 128)
    with pytest.raises(RuntimeError, match="tables must be contiguous float16"):
        torch.ops.structkv.int4_tiled_linear(torch.randn(1, 64), tiles, scale.to(torch.bfloat16), lo, 128)
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        torch.ops.structkv.int4_tiled_linear(torch.randn(1, 64), tiles.view(2, -1), scale, lo, 128)
    t8, s8 = int8_of(weight_of(32, 64, 0))
    with pytest.raises(RuntimeError, match=r"scales must be contiguous bfloat16 \(N,\) = \(32,\)"):
        torch.ops.structkv.int8_tiled_linear(torch.randn(1, 64), t8, s8[:16], 128)
    with pytest.raises(RuntimeError, match="codes must be contiguous int8"):
        torch.ops.structkv.int8_tiled_linear(torch.randn(1, 64), t8.view(torch.uint8), s8, 128)
    with pytest.raises(ValueError, match="out_features % 16"):
        T.pack_int4(*T.quantize_int4(torch.randn(40, 64)))
    with pytest.raises(ValueError, match="float16's range"):
        T.quantize_int4(torch.full((16, 32), 1e6))
    with pytest.raises(ValueError, match="layout must be"):
        QuantizedLinear.from_weight(torch.randn(32, 64), "int4", layout="tiles")
    with pytest.raises(ValueError, match="use layout='packed'"):
        QuantizedLinear.from_weight(torch.randn(40, 64), "int8", layout="tiled")


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_linear_uses_the_tiled_layout_where_it_is_fast(kind):
    assert QuantizedLinear.from_weight(torch.randn(32, 64), kind).layout == ("tiled" if T.available() else "packed")
    assert QuantizedLinear.from_weight(torch.randn(40, 64), "int8").layout == "packed"  # does not tile
    lin = QuantizedLinear.from_weight(torch.randn(32, 64), kind, layout="tiled", bias=torch.randn(32))
    x = torch.randn(2, 3, 64)
    stored = (lin.tiles, lin.tile_scale, lin.tile_min) if kind == "int4" else (lin.tiles, lin.scales)
    torch.testing.assert_close(lin(x), reference(kind, x.view(6, 64), stored).view(2, 3, 32) + lin.bias, rtol=0,
                               atol=1e-4)
    # int4: codes and two float16 tables, 0.625 bytes a weight; int8: codes and a bf16 scale a row
    assert lin.nbytes() == (32 * 64 // 2 + 2 * 32 * 2 * 2 if kind == "int4" else 32 * 64 + 32 * 2)


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("layout", ["tiled", "packed"])
def test_generation_on_either_layout_compiled_equals_eager(tiny_dir, monkeypatch, weights, layout):
    """A model's quantized weights in either layout (the tied head and embedding included): the
    compiled decode step gives the eager tokens (the op sits in the graph)."""
    import structkv.models.quantized as Q

    monkeypatch.setattr(Q, "default_layout", lambda device, N, K: layout if T.fits(N, K) else "packed")
    model = structkv.load(tiny_dir("llama"), weights=weights)
    layouts = {m.layout for m in model.modules() if isinstance(m, QuantizedLinear) and m.kind != "bf16"}
    assert layout in layouts
    ids = torch.randint(3, 90, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    eager = structkv.generate(model, ids, max_new_tokens=6, compile=False).token_ids
    assert structkv.generate(model, ids, max_new_tokens=6, compile=True).token_ids == eager


def test_turned_off_the_packed_kernels_are_used(monkeypatch):
    monkeypatch.setenv("STRUCTKV_CPU_KERNELS", "0")
    T._load.cache_clear()
    try:
        assert not T.available() and "STRUCTKV_CPU_KERNELS=0" in T.unavailable_reason()
        assert {QuantizedLinear.from_weight(torch.randn(32, 64), k).layout for k in ("int4", "int8")} == {"packed"}
    finally:
        T._load.cache_clear()
