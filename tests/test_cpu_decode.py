"""The CPU decode-attention kernel (`structkv::cpu_decode_attention`, C built on first use) against
its definition, PyTorch's attention over the dequantized entries: every entry kind, masks with
holes or per KV head, views of larger buffers, 1-2 threads and key-range splits (hypothesis);
the positions op against the mask op for `visible`'s masks (hypothesis); the ops' registration
(opcheck); the fallback where it cannot be built; and generation through
it equal to generation without it, eager and compiled."""
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import structkv
from structkv.ops import cpu_decode, decode_attention, dequantize_kv, quantize_kv, visible

KINDS = ["float32", "bfloat16", "int8", "int4"]
pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason=f"no CPU kernel: {cpu_decode.unavailable_reason()}")


def planes(x: torch.Tensor, kind: str) -> list[torch.Tensor]:
    return [x.to(getattr(torch, kind))] if kind in ("float32", "bfloat16") else list(quantize_kv(x, kind))


def floats(p: list[torch.Tensor], kind: str) -> torch.Tensor:
    return p[0].float() if kind in ("float32", "bfloat16") else dequantize_kv(p, kind)


@given(st.sampled_from(KINDS), st.integers(1, 2), st.integers(1, 3), st.integers(1, 5),
       st.sampled_from([16, 32, 64, 96, 256, 512]), st.integers(1, 700), st.integers(0, 40), st.booleans(),
       st.integers(1, 2), st.integers(0, 2**16))
def test_kernel_equals_attention_over_the_same_entries(kind, B, Hkv, G, D, T, spare, per_head, threads, seed):
    """Output within float rounding of SDPA over the entries the kernel reads, for caches that
    are views of larger buffers (`spare` unused slots), masks with holes (a hidden prefix, random
    gaps) shared or per KV head."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=gen)
    k_all, v_all = (torch.randn(B, Hkv, T + spare, D, generator=gen) * 2 for _ in range(2))
    kp = [p[:, :, :T] for p in planes(k_all, kind)]  # views: stride over slots from the larger buffer
    vp = [p[:, :, :T] for p in planes(v_all, kind)]
    mask = torch.rand(B, Hkv if per_head else 1, 1, T, generator=gen) > 0.25
    mask[..., :T // 3] &= torch.rand(1, generator=gen).item() > 0.5  # sometimes a hidden prefix
    mask[..., -1] = True  # every row sees a key (the all-hidden row has its own test)
    out = cpu_decode.cpu_decode_attention(q, kp, vp, mask, 0.3, kind, threads)
    want = decode_attention(q, floats(kp, kind), floats(vp, kind), mask, 0.3)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@given(st.sampled_from(KINDS), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.sampled_from([16, 64, 256]),
       st.integers(1, 400), st.sampled_from([None, 1, 7, 64]), st.integers(1, 2), st.integers(0, 2**16))
def test_positions_decide_what_the_mask_of_visible_would(kind, B, Hkv, G, D, T, window, threads, seed):
    """`cpu_decode_attention_at` (the keys each row sees decided in the kernel from the slots'
    positions and the query's) gives the mask op's numbers for `structkv.ops.visible`'s mask:
    empty slots (-1), future slots, rows at different positions, per-head positions, windows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=gen)
    kp, vp = (planes(torch.randn(B, Hkv, T, D, generator=gen), kind) for _ in range(2))
    pos = torch.randint(-1, T + 20, (B, Hkv, T), generator=gen)
    at = torch.randint(0, T + 20, (B, 1), generator=gen)
    out = cpu_decode.cpu_decode_attention_at(q, kp, vp, pos, at, window, 0.3, kind, threads)
    want = cpu_decode.cpu_decode_attention(q, kp, vp, visible(at, pos, window), 0.3, kind, threads)
    assert torch.equal(out, want)


def test_positions_op_opcheck_and_bad_input():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 32, generator=gen)
    kp, vp = ([torch.randn(2, 2, 300, 32, generator=gen)] for _ in range(2))
    pos, at = torch.arange(300).expand(2, 2, 300).contiguous(), torch.tensor([[299], [150]])
    op = torch.ops.structkv.cpu_decode_attention_at.default
    torch.library.opcheck(op, (q, kp, vp, pos, at, 0, 0.25, "float32", 2))
    with pytest.raises(RuntimeError, match=r"pos must be int64 \(B, Hkv, T\) = \(2, 2, 300\)"):
        cpu_decode.cpu_decode_attention_at(q, kp, vp, pos.int(), at, None, 0.25, "float32", 2)
    with pytest.raises(RuntimeError, match="one query position a row"):
        cpu_decode.cpu_decode_attention_at(q, kp, vp, pos, at[:1], None, 0.25, "float32", 2)


@pytest.mark.parametrize("shown", [(0, 100), (3000, 3300), (1000, 3100)])
def test_key_ranges_follow_the_visible_slots_not_the_capacity(shown):
    """A large cache with few visible slots (a compressed or just-started cache): the kernel picks
    its key ranges from the slots its mask shows (few ranges for few keys, more for many), and
    the answer is the same either way."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 1, 64, generator=gen)
    k, v = ([torch.randn(1, 3, 4096, 64, generator=gen)] for _ in range(2))
    mask = torch.zeros(1, 1, 1, 4096, dtype=torch.bool)
    mask[..., shown[0]:shown[1]] = True
    out = cpu_decode.cpu_decode_attention(q, k, v, mask, 0.125, "float32", 2)
    torch.testing.assert_close(out, decode_attention(q, k[0], v[0], mask, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_opcheck_and_bfloat16_queries(kind):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 32, generator=gen)
    kp, vp = (planes(torch.randn(1, 2, 300, 32, generator=gen), kind) for _ in range(2))
    mask = torch.rand(1, 1, 1, 300, generator=gen) > 0.5
    torch.library.opcheck(torch.ops.structkv.cpu_decode_attention.default, (q, kp, vp, mask, 0.25, kind, 2))
    out = cpu_decode.cpu_decode_attention(q.bfloat16(), kp, vp, mask, 0.25, kind, 2)
    assert out.dtype == torch.bfloat16
    want = decode_attention(q.bfloat16().float(), floats(kp, kind), floats(vp, kind), mask, 0.25)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_a_row_that_sees_nothing_gives_zeros_and_the_others_are_unaffected():
    q = torch.randn(2, 2, 1, 16)
    k, v = torch.randn(2, 1, 40, 16), torch.randn(2, 1, 40, 16)
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[1] = False
    out = cpu_decode.cpu_decode_attention(q, [k], [v], mask, 0.25, "float32", 2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[:1], decode_attention(q[:1], k[:1], v[:1], mask[:1], 0.25))


def test_large_scores_do_not_overflow():
    """Scores of a few hundred (the online softmax subtracts the running maximum)."""
    q = torch.full((1, 2, 1, 64), 3.0)
    k, v = torch.randn(1, 1, 500, 64) * 4, torch.randn(1, 1, 500, 64)
    mask = torch.ones(1, 1, 1, 500, dtype=torch.bool)
    out = cpu_decode.cpu_decode_attention(q, [k], [v], mask, 1.0, "float32", 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_attention(q, k, v, mask, 1.0), atol=2e-5, rtol=1e-4)


def test_shapes_past_the_limits_are_refused_by_fits():
    assert cpu_decode.fits(torch.zeros(1, 4, 1, 64), torch.zeros(1, 2, 8, 64))
    assert not cpu_decode.fits(torch.zeros(1, 4, 1, 40), torch.zeros(1, 2, 8, 40))  # D not a multiple of 16
    assert not cpu_decode.fits(torch.zeros(1, 34, 1, 64), torch.zeros(1, 2, 8, 64))  # G = 17
    with pytest.raises(ValueError, match="check `fits` first"):
        kv = [torch.zeros(1, 2, 8, 40)]
        cpu_decode.cpu_decode_attention(torch.zeros(1, 4, 1, 40), kv, kv, torch.ones(1, 1, 1, 8, dtype=torch.bool), 1.0,
                                        "float32", 1)


@pytest.mark.parametrize("env, reason", [({"STRUCTKV_CPU_KERNELS": "0"}, "STRUCTKV_CPU_KERNELS=0"),
                                         ({"CXX": "/nonexistent/c++"}, "could not be built")])
def test_without_the_kernel_caches_fall_back_to_sdpa(monkeypatch, tmp_path, tiny_dir, env, reason):
    """Turned off, or no working compiler: `available()` says why (a failed build also warns: it is
    not what the user asked for), a cache made then runs PyTorch's SDPA, and generation is the same."""
    model = structkv.load(tiny_dir("llama"))
    ids = torch.randint(3, 90, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    want = structkv.generate(model, ids, max_new_tokens=6)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path))  # no earlier build to find
    cpu_decode._load.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert not cpu_decode.available() and reason in cpu_decode.unavailable_reason()
        warned = [str(w.message) for w in said if issubclass(w.category, RuntimeWarning)]
        assert bool(warned) == ("CXX" in env) and all("falls back" in w for w in warned), warned
        got = structkv.generate(model, ids, max_new_tokens=6)
    finally:
        cpu_decode._load.cache_clear()
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize("arch, kv_dtype, compiles", [("llama", None, (False, True)), ("llama", "int8", (False,)),
                                                      ("llama", "int4", (False,)), ("llama", "bf16", (False, True)),
                                                      ("gemma3_text", None, (False,)),
                                                      ("gemma3_text", "int4", (False, True))])
def test_generation_through_the_kernel_equals_generation_without(monkeypatch, tiny_dir, arch, kv_dtype, compiles):
    """Every CPU cache's `attend` runs the kernel when it is built; without it (the SDPA /
    dequantizing reference) the same greedy tokens, eager and with the compiled decode step
    (sliding-window rings included: Gemma's tiny config has W = 8)."""
    model = structkv.load(tiny_dir(arch), kv_dtype=kv_dtype)
    ids = torch.randint(3, 90, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    got = {}
    for kernel in (True, False):
        monkeypatch.setattr(cpu_decode, "available", lambda kernel=kernel: kernel)
        for compile in compiles:
            got[kernel, compile] = structkv.generate(model, ids, max_new_tokens=8, compile=compile).token_ids
    assert len(set(map(tuple, got.values()))) == 1, got
