"""Every Triton kernel compiled ahead of time for sm_80 and sm_90 (no GPU needed): it compiles at
the blocks its wrapper picks, fits the registers and shared memory, spills nothing, runs its
window products on tensor cores and offsets its batch / head slices in 64 bits.

The first run compiles 90 kernels (about 2 minutes on 2 cores); Triton caches them afterwards.
"""
import re

import pytest

pytest.importorskip("triton", reason="triton is not installed")
from structkv.ops import triton_aot  # noqa: E402
from structkv.ops import triton_kernels as tk  # noqa: E402

GRID = [(arch, dtype, d) for arch in triton_aot.ARCHS for dtype in triton_aot.DTYPES for d in triton_aot.HEAD_DIMS]


@pytest.mark.parametrize("arch,dtype,head_dim", GRID)
def test_kernels_fit_without_spills(arch, dtype, head_dim):
    for r in triton_aot.report(arch, dtype, head_dim):
        assert r.registers <= 255, r
        assert r.spill_stores == 0 and r.stack_bytes == 0, r
        assert r.shared_bytes <= triton_aot.MAX_SHARED[arch], r
        if r.kernel.startswith("window_") and dtype != "fp32":
            assert r.tensor_core_ops > 0, r  # bf16 / fp16 products on HMMA (sm_80) or HGMMA (sm_90)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_slice_offsets_are_64_bit(dtype):
    """`b * stride_b + h * stride_h` in int64: a cache of B x Hkv x N x D > 2^31 elements (batch 17
    at 128K, D 128) would otherwise wrap to a wrong address."""
    for name, fn, pointers, floats, constexprs in triton_aot._cases(dtype, 128):
        ttir = triton_aot.compile_kernel(fn, pointers, floats, constexprs, 90).asm["ttir"]
        bases = re.findall(r"tt\.addptr %([A-Z_]+), %\S+ : !tt\.ptr<\w+>, (\w+)", ttir)
        assert bases, name
        assert {ty for _, ty in bases} == {"i64"}, (name, bases)


def test_key_splits_fill_the_gpu_at_batch_one():
    """Llama-3.1-8B at 32K, batch 1: 32 query heads, one window block; an H100 has 132 SMs."""
    blocks = tk.window_config(64, 128, None)
    n_blocks = 32768 // blocks["BLOCK_N"]
    splits = tk.key_splits(32, n_blocks, 132)
    assert 32 * splits >= 132
    assert n_blocks // splits >= tk.MIN_BLOCKS_PER_SPLIT
    assert tk.key_splits(32, 3, 132) == 1  # a short cache stays whole
    assert tk.key_splits(32, n_blocks, 0) == 1  # no GPU (the interpreter): one part
