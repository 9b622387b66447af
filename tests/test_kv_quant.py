"""Quantized KV entries (kv_dtype "int8" / "int4"): the codec's error bound (hypothesis), the
decode op against its dequantize-then-attend definition, caches that hold exactly the quantized
float cache through every write path (prefill, compaction, rings, decode writes, stacking, KVzip's
reconstruction), the stored bytes, and generation close to the float cache, compiled or not."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.models.kv_cache import LayerKVCache, StackedKVCache
from structkv.ops import decode_attention, dequantize_kv, quantize_kv, quantized_decode_attention

KINDS = ["bf16", "int8", "int4"]
CODED = ["int8", "int4"]  # the kinds with codes and scale tables


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def model(request, tiny_dir):
    return structkv.load(tiny_dir(request.param))


@given(st.sampled_from(CODED), st.integers(1, 3), st.integers(1, 9), st.sampled_from([2, 16, 64]),
       st.floats(1e-3, 1e3), st.integers(0, 2**16))
def test_quantized_entries_are_within_half_a_step(kind, B, S, D, spread, seed):
    """Each (token, head) entry comes back within half its own step (the step of the
    rounded-up bfloat16 scale), so one large entry never costs another its precision."""
    x = torch.randn(B, 2, S, D, generator=torch.Generator().manual_seed(seed)) * spread
    x[:, :, :1] *= 100  # an outlier token
    back = dequantize_kv(quantize_kv(x, kind), kind)
    if kind == "int8":
        step = x.abs().amax(-1, keepdim=True) / 127
    else:  # per group of 32 dimensions (the whole head when 32 does not divide it)
        g = x.unflatten(-1, (D // 32, 32)) if D % 32 == 0 else x[..., None, :]
        step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).flatten(-2)
    assert ((back - x).abs() <= 0.5 * step * 1.01 + 1e-5 * x.abs().amax(-1, keepdim=True)).all()
    assert torch.isfinite(back).all()


@given(st.integers(1, 9), st.sampled_from([2, 16, 64]), st.floats(1e-30, 1e30), st.integers(0, 2**16))
def test_bf16_entries_are_the_entries_rounded_to_bfloat16(S, D, spread, seed):
    """bf16 storage is a rounding, nothing else: one plane, no tables, round-to-nearest of each value."""
    x = torch.randn(1, 2, S, D, generator=torch.Generator().manual_seed(seed)) * spread
    planes = quantize_kv(x, "bf16")
    assert len(planes) == 1 and planes[0].dtype == torch.bfloat16
    assert torch.equal(dequantize_kv(planes, "bf16"), x.to(torch.bfloat16).float())


def test_zero_entries_are_exact_and_constant_ones_too_in_int4():
    for kind in KINDS:
        x = torch.zeros(1, 1, 3, 8)
        x[0, 0, 1] = 2.5  # a constant entry: int4's scale is 0, its minimum the value
        back = dequantize_kv(quantize_kv(x, kind), kind)
        assert torch.equal(back[0, 0, ::2], x[0, 0, ::2]) and torch.isfinite(back).all()
        if kind == "int4":
            assert torch.equal(back, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_decode_op_equals_attention_over_dequantized_entries(kind, heads):
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, Hq, 1, 16, generator=g)
    k, v = torch.randn(2, Hkv, 20, 16, generator=g), torch.randn(2, Hkv, 20, 16, generator=g)
    mask = torch.rand(2, Hkv, 1, 20, generator=g) > 0.3
    kp, vp = list(quantize_kv(k, kind)), list(quantize_kv(v, kind))
    out = quantized_decode_attention(q, kp, vp, mask, 0.25, kind)
    want = decode_attention(q, dequantize_kv(kp, kind), dequantize_kv(vp, kind), mask, 0.25)
    torch.testing.assert_close(out, want)
    assert (out - decode_attention(q, k, v, mask, 0.25)).abs().max() < {"bf16": 0.02, "int8": 0.05, "int4": 0.5}[kind]
    torch.library.opcheck(torch.ops.structkv.quantized_decode_attention.default, (q, kp, vp, mask, 0.25, kind))


def _same_entries(float_cache, quant_cache, kind):
    """Every plane of the quantized cache is the float cache's entries quantized."""
    for fl, ql in zip(float_cache.layers, quant_cache.layers):
        assert torch.equal(fl.pos, ql.pos)
        for side, names in (("k", ql.planes[:len(ql.planes) // 2]), ("v", ql.planes[len(ql.planes) // 2:])):
            want = quantize_kv(getattr(fl, side), kind)
            for name, plane in zip(names, want):
                assert torch.equal(getattr(ql, name), plane), (side, name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["full", "snapkv", "structkv", "kvzip"])
def test_every_write_path_stores_the_quantized_float_entries(model, kind, name):
    """Prefill (static cache, compaction, rings), questions appended, decode writes and stacking:
    the quantized cache holds exactly the float cache's entries, quantized. (KVzip reads its own
    rings while scoring, so its selection may differ: budget and accounting only.)"""
    ids = torch.randint(3, 96, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    method = methods.build(name, kv=20) if name != "full" else None
    states = {}
    for kv_dtype in (None, kind):
        model.kv_dtype = kv_dtype
        try:
            states[kv_dtype] = structkv.prefill(model, ids, method or methods.get("full"), room=16)
        finally:
            model.kv_dtype = None
    fl, qu = states[None], states[kind]
    assert [layer.kv_dtype for layer in qu.cache.layers] == [kind] * model.config.num_layers
    if name != "kvzip":
        _same_entries(fl.cache, qu.cache, kind)
        stacked_f, stacked_q = StackedKVCache([fl.cache, fl.cache]), StackedKVCache([qu.cache, qu.cache])
        _same_entries(stacked_f, stacked_q, kind)
    assert qu.stats.kv_bytes <= fl.stats.kv_bytes / {"bf16": 2, "int8": 3.5, "int4": 4}[kind]  # tiny heads: 16 dims
    if name == "kvzip":  # its own selection: the budget, exactly
        full_layers = model.config.full_attention_layers
        assert all(int((qu.cache.layers[i].pos[0] >= 0).sum(-1).max()) == 20 for i in full_layers)
    before = [b.clone() for layer in qu.cache.layers for b in layer.buffers()]
    for _ in range(2):  # ask twice: each question extends its own copy of the quantized state
        out = structkv.generate(model, [5, 6, 7], state=qu, max_new_tokens=4, compile=False, stop_at_eos=False)
        assert len(out.token_ids) == 4
    assert all(torch.equal(a, b) for a, b in zip(before, [b for layer in qu.cache.layers for b in layer.buffers()]))


@pytest.mark.parametrize("kind", KINDS)
def test_entry_bytes_count_the_scale_tables(kind):
    D = 64
    layer = LayerKVCache(1, 2, 8, D, torch.float32, "cpu", kv_dtype=kind)
    per_side = {"bf16": 2 * D, "int8": D + 2, "int4": D // 2 + 6 * D // 32}[kind]
    assert layer.entry_bytes() == 2 * per_side
    assert layer.nbytes() == 2 * per_side * 2 * 8
    if kind == "int8":  # the targets: <= 1/1.8 of bf16, <= 1/3.5 of fp32
        assert 2 * 2 * D / layer.entry_bytes() >= 1.8 and 2 * 4 * D / layer.entry_bytes() >= 3.5


def test_bad_kv_dtype_is_refused_by_name(tiny_dir):
    with pytest.raises(ValueError, match="kv_dtype must be None.*'int8' or 'int4'"):
        structkv.load(tiny_dir("llama"), kv_dtype="fp8")
    with pytest.raises(ValueError, match="head_dim must be even"):
        LayerKVCache(1, 1, 4, 7, torch.float32, "cpu", kv_dtype="int4")


@pytest.mark.parametrize("compile", [False, True])
def test_generation_with_int8_entries_stays_close_to_the_float_cache(tiny_dir, compile):
    """Greedy logits of a decode over int8 entries stay close to the float cache's; the compiled
    decode step (the op is opaque to it) gives the eager step's tokens."""
    model = structkv.load(tiny_dir("llama"))
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    base = structkv.generate(model, ids, max_new_tokens=6, compile=False, stop_at_eos=False)
    model.kv_dtype = "int8"
    eager = structkv.generate(model, ids, max_new_tokens=6, compile=False, stop_at_eos=False)
    assert eager.token_ids == base.token_ids
    if compile:
        compiled = structkv.generate(model, ids, max_new_tokens=6, compile=True, stop_at_eos=False)
        assert compiled.token_ids == eager.token_ids
