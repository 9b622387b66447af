"""Triton kernels under the interpreter (TRITON_INTERPRET=1, CPU tensors) against the references.

Run in their own process: `TRITON_INTERPRET=1 pytest -m triton_interpret` (the variable is read
when kernels are decorated). This proves indexing and masking, not speed.
"""
import os

import pytest
import torch

pytestmark = pytest.mark.triton_interpret
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 in a separate process", allow_module_level=True)
triton_kernels = pytest.importorskip("structkv.ops.triton_kernels", reason="triton is not installed")

from structkv.ops import compact_kv_reference, window_scores_naive  # noqa: E402

CASES = [  # B, Hq, Hkv, w, N, D, pad, window, softcap
    (1, 4, 2, 8, 50, 64, 0, 0, 0.0),
    (2, 8, 2, 3, 97, 32, 11, 0, 0.0),
    (1, 2, 2, 20, 70, 16, 0, 16, 0.0),
    (2, 4, 1, 70, 40, 64, 5, 0, 30.0),  # w > N and w > BLOCK_W
    (1, 8, 1, 32, 130, 256, 3, 64, 0.0),
]


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_window_scores_triton_matches_reference(case, dtype, splits):
    """Each dtype runs its own tl.dot (fp16 / bf16 products are exact in float32; the interpreter
    has no bf16 arithmetic, so bf16 is checked on a GPU by benchmarks/gpu_check.sh); `splits`
    cuts the keys of the first pass into parts merged afterwards, as a GPU at batch 1 does."""
    B, Hq, Hkv, w, N, D, pad, window, softcap = case
    g = torch.Generator().manual_seed(sum(case[:6]))
    q = torch.randn(B, Hq, w, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    k_pos = torch.cat([torch.full((B, pad), -1), torch.arange(N - pad).expand(B, -1)], 1)
    q_pos = (k_pos[:, -1:] - w + 1 + torch.arange(w)).clamp_min(-1)
    sal, ent = triton_kernels.window_scores_triton(q, k, q_pos, k_pos, D**-0.5, window, softcap, splits=splits)
    ref_sal, ref_ent = window_scores_naive(q, k, q_pos, k_pos, D**-0.5, window, softcap)
    assert torch.allclose(sal, ref_sal, atol=1e-5, rtol=1e-4)
    assert torch.allclose(ent, ref_ent, atol=1e-4, rtol=1e-4)


def test_window_scores_triton_strided_inputs():
    q = torch.randn(1, 6, 4, 32).transpose(1, 2)  # (1, 4, 6, 32) non-contiguous
    k = torch.randn(1, 40, 2, 32).transpose(1, 2)  # (1, 2, 40, 32)
    k_pos = torch.arange(40)[None]
    q_pos = torch.arange(34, 40)[None]
    sal, ent = triton_kernels.window_scores_triton(q, k, q_pos, k_pos, 0.2, 0, 0.0)
    ref_sal, ref_ent = window_scores_naive(q, k, q_pos, k_pos, 0.2)
    assert torch.allclose(sal, ref_sal, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-4)


def test_window_scores_triton_without_entropy():
    """entropy=False: the same saliency, no entropy accumulated or stored."""
    q, k = torch.randn(1, 4, 5, 32), torch.randn(1, 2, 70, 32)
    k_pos, q_pos = torch.arange(70)[None], torch.arange(65, 70)[None]
    sal, ent = triton_kernels.window_scores_triton(q, k, q_pos, k_pos, 0.2, 0, 0.0, entropy=False)
    assert ent.shape == (1, 4, 0)
    assert torch.allclose(sal, window_scores_naive(q, k, q_pos, k_pos, 0.2)[0], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8, torch.uint8, torch.bfloat16])
def test_compact_kv_triton_matches_reference(dtype):
    """Float entries, and the planes of quantized ones (codes, bfloat16 scale tables)."""
    B, H, N, D, C = 2, 2, 50, 48, 40
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(B, H, N, D, generator=g) * 30).to(dtype), (torch.randn(B, H, N, D, generator=g) * 30).to(dtype)
    k_pos = torch.arange(N).expand(B, -1).contiguous()
    idx = torch.stack([torch.randperm(N, generator=g)[:35].sort().values for _ in range(B * H)]).view(B, H, 35)
    idx[1, 0, 30:] = -1
    outs = []
    for fn in (triton_kernels.compact_kv_triton, compact_kv_reference):
        bufs = (torch.zeros(B, H, C, D, dtype=dtype), torch.zeros(B, H, C, D, dtype=dtype),
                torch.zeros(B, H, C, dtype=torch.long))
        fn(*bufs, k, v, k_pos, idx)
        outs.append(bufs)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


QUANT_CASES = [  # B, Hq, Hkv, T, D, per-KV-head mask
    (1, 4, 2, 37, 16, False),
    (2, 2, 2, 70, 64, True),
    (2, 8, 1, 33, 256, False),  # Gemma 3 270M's head: one KV head, 256 dims
]


@pytest.mark.parametrize("splits", [None, 2])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("case", QUANT_CASES)
def test_quantized_decode_attention_triton_matches_reference(case, kind, splits):
    from structkv.ops.kv_quant import quantize_kv, quantized_decode_attention_reference

    B, Hq, Hkv, T, D, per_head = case
    g = torch.Generator().manual_seed(T)
    q = torch.randn(B, Hq, 1, D, generator=g)
    k, v = list(quantize_kv(torch.randn(B, Hkv, T, D, generator=g), kind)), list(
        quantize_kv(torch.randn(B, Hkv, T, D, generator=g), kind))
    mask = torch.rand(B, Hkv if per_head else 1, 1, T, generator=g) > 0.4
    mask[0, ..., :] = False  # a row that sees a single entry
    mask[0, ..., 3] = True
    want = quantized_decode_attention_reference(q, k, v, mask, D ** -0.5, kind)
    got = triton_kernels.quantized_decode_attention_triton(q, k, v, mask, D ** -0.5, kind, splits=splits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
