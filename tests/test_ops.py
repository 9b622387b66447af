"""Custom ops: the chunked reference against the materialised definition, invariants, registration."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

from structkv.ops import compact_kv, window_scores, window_scores_naive, window_scores_reference


@st.composite
def scores_case(draw):
    seed = draw(st.integers(0, 2**16))
    B = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    D = draw(st.sampled_from([64, 128, 256]))
    N = draw(st.integers(1, 160))
    w = draw(st.integers(1, 64))
    pads = [draw(st.integers(0, N - 1)) for _ in range(B)]
    sliding_window = draw(st.one_of(st.none(), st.integers(1, 48)))
    softcap = draw(st.one_of(st.none(), st.floats(2.0, 50.0)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    chunk = draw(st.sampled_from([7, 32, 2048]))
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, hkv * ratio, w, D, generator=g) * 2).to(dtype)
    k = (torch.randn(B, hkv, N, D, generator=g) * 2).to(dtype)
    k_pos = torch.stack([torch.cat([torch.full((p,), -1), torch.arange(N - p)]) for p in pads])
    # Window queries: the last w positions of each row (beyond the keys when w > N), -1 where < 0.
    last = k_pos[:, -1:]
    q_pos = last - w + 1 + torch.arange(w)[None]
    q_pos = torch.where(q_pos < 0, torch.full_like(q_pos, -1), q_pos)
    return q, k, q_pos, k_pos, D**-0.5, sliding_window, softcap, chunk


@given(scores_case())
def test_reference_matches_naive(case):
    q, k, q_pos, k_pos, scale, sliding_window, softcap, chunk = case
    sal, ent = window_scores_reference(q, k, q_pos, k_pos, scale, sliding_window or 0, softcap or 0.0, chunk=chunk)
    sal_n, ent_n = window_scores_naive(q, k, q_pos, k_pos, scale, sliding_window or 0, softcap or 0.0)
    assert torch.allclose(sal, sal_n, atol=1e-5, rtol=1e-5)
    assert torch.allclose(ent, ent_n, atol=1e-5, rtol=1e-5)


@given(scores_case())
def test_invariants(case):
    q, k, q_pos, k_pos, scale, sliding_window, softcap, _ = case
    sal, ent = window_scores(q, k, q_pos, k_pos, scale=scale, sliding_window=sliding_window, softcap=softcap,
                             entropy=True)
    B, Hq, w, _ = q.shape
    G = Hq // k.shape[1]
    assert sal.dtype == torch.float32 and ent.dtype == torch.float32
    assert (sal >= 0).all()
    vis = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # (B, w, N)
    if sliding_window:
        vis &= q_pos[:, :, None] - k_pos[:, None, :] < sliding_window
    n_vis = vis.sum(-1)  # (B, w)
    # every query row that sees a key puts mass 1 on visible keys: rows sum to G * (rows seeing) / w
    expected = G * (n_vis > 0).sum(-1, keepdim=True).float() / w  # (B, 1)
    assert torch.allclose(sal.sum(-1), expected.expand(-1, sal.shape[1]), atol=1e-4)
    invisible = ~vis.any(1)  # (B, N): keys no window query sees
    assert (sal.masked_select(invisible[:, None, :].expand_as(sal)) == 0).all()
    bound = torch.log(n_vis.clamp_min(1).float())[:, None, :].expand_as(ent)
    assert (ent >= 0).all() and (ent <= bound + 1e-4).all()


def test_chunked_reference_never_materialises_full_scores(monkeypatch):
    """The reference only ever builds (.., w, chunk) logit tiles, never (Hq, w, N). Peak memory in
    bytes is measured by benchmarks/ops_memory.py (RSS in a subprocess)."""
    import structkv.ops.saliency as ws

    widths = []
    real = ws._logits
    monkeypatch.setattr(ws, "_logits", lambda *a: widths.append(real(*a).shape[-1]) or real(*a))
    q, k = torch.randn(1, 8, 32, 64), torch.randn(1, 2, 5000, 64)
    pos = torch.arange(5000)[None]
    sal, _ = ws.window_scores_reference(q, k, pos[:, -32:], pos, 0.125, chunk=1024)
    assert max(widths) == 1024 and len(widths) == 2 * 5  # two passes over 5 chunks
    assert torch.allclose(sal, window_scores_naive(q, k, pos[:, -32:], pos, 0.125)[0], atol=1e-5)


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("shape", ["contiguous", "transposed", "sliced", "empty"])
def test_opcheck_window_scores(shape, entropy):
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 10, 16)
    if shape == "transposed":
        q = torch.randn(1, 3, 4, 16).transpose(1, 2)
        k = torch.randn(1, 10, 2, 16).transpose(1, 2)
    elif shape == "sliced":
        q = torch.randn(1, 4, 6, 32)[:, :, ::2, :16]
        k = torch.randn(1, 2, 20, 16)[:, :, 5:15]
    elif shape == "empty":
        k = torch.randn(1, 2, 0, 16)
    N = k.shape[2]
    k_pos = torch.arange(N)[None]
    q_pos = torch.arange(max(N - 3, 0), max(N - 3, 0) + 3)[None]
    torch.library.opcheck(torch.ops.structkv.window_scores.default, (q, k, q_pos, k_pos, 0.25, 0, 0.0, entropy))


@given(scores_case())
def test_entropy_is_only_computed_when_asked(case):
    """Without `entropy` the op returns the same saliency and no entropy tensor (its accumulator is
    skipped, not computed and dropped)."""
    q, k, q_pos, k_pos, scale, sliding_window, softcap, _ = case
    sal = window_scores(q, k, q_pos, k_pos, scale=scale, sliding_window=sliding_window, softcap=softcap)
    both = window_scores(q, k, q_pos, k_pos, scale=scale, sliding_window=sliding_window, softcap=softcap, entropy=True)
    assert torch.equal(sal, both[0])
    _, none = torch.ops.structkv.window_scores(q, k, q_pos, k_pos, scale, sliding_window or 0, softcap or 0.0, False)
    assert none.shape == (q.shape[0], q.shape[1], 0)


@pytest.mark.parametrize("shape", ["contiguous", "transposed", "empty"])
def test_opcheck_compact_kv(shape):
    B, H, N, D, C, M = 1, 2, 10, 8, 6, 4
    k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    if shape == "transposed":
        k = torch.randn(B, N, H, D).transpose(1, 2)
    if shape == "empty":
        M = 0
    idx = torch.stack([torch.randperm(N)[:M].sort().values for _ in range(B * H)]).view(B, H, M)
    args = (torch.zeros(B, H, C, D), torch.zeros(B, H, C, D), torch.full((B, H, C), -1),
            k, v, torch.arange(N)[None] + 100, idx)
    torch.library.opcheck(torch.ops.structkv.compact_kv.default, args)


def test_compact_kv_gathers_and_counts_entries_by_position():
    B, H, N, D, C = 2, 2, 9, 4, 6
    k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    k_pos = torch.stack([torch.arange(N) + 10, torch.arange(N) - 3]).clamp_min(-1)
    idx = torch.tensor([[[0, 3, 8, -1], [1, 2, 4, 5]], [[4, 5, 6, 7], [5, -1, -1, -1]]])
    kc, vc = torch.full((B, H, C, D), 7.0), torch.full((B, H, C, D), 7.0)
    pc = torch.zeros(B, H, C, dtype=torch.long)
    compact_kv(kc, vc, pc, k, v, k_pos, idx)
    assert (pc >= 0).sum(-1).tolist() == [[3, 4], [4, 1]]  # a head's entries: its valid positions
    for b in range(B):
        for h in range(H):
            sel = [i for i in idx[b, h].tolist() if i >= 0]
            n = len(sel)
            assert torch.equal(kc[b, h, :n], k[b, h, sel]) and torch.equal(vc[b, h, :n], v[b, h, sel])
            assert pc[b, h, :n].tolist() == k_pos[b, sel].tolist()
            assert (pc[b, h, n:] == -1).all()


def test_compile_dynamic_n_one_compile():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(fullgraph=True, backend=counter)
    def step(q, k, v, q_pos, k_pos, kc, vc, pc):
        sal, ent = window_scores(q, k, q_pos, k_pos, scale=0.25, entropy=True)
        idx = sal.topk(4, dim=-1).indices.sort(-1).values  # (B, Hkv, 4)
        compact_kv(kc, vc, pc, k, v, k_pos, idx)
        return sal, ent

    for N in (12, 20, 37):
        q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, N, 16), torch.randn(1, 2, N, 16)
        k_pos = torch.arange(N)[None]
        q_pos = torch.arange(N - 3, N)[None]
        for t in (k, v, k_pos):
            torch._dynamo.mark_dynamic(t, t.dim() - 2 if t.dim() == 4 else 1)
        kc, vc = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
        pc = torch.full((1, 2, 8), -1)
        sal, ent = step(q, k, v, q_pos, k_pos, kc, vc, pc)
        ref_sal, ref_ent = window_scores_naive(q, k, q_pos, k_pos, 0.25)
        assert torch.allclose(sal, ref_sal, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
        idx = ref_sal.topk(4, dim=-1).indices.sort(-1).values
        assert torch.equal(kc[:, :, :4], k.gather(2, idx[..., None].expand(-1, -1, -1, 16)))
        assert ((pc >= 0).sum(-1) == 4).all()
    assert counter.frame_count == 1


def test_window_scores_bad_input():
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16)
    qp, kp = torch.arange(7, 10)[None], torch.arange(10)[None]
    with pytest.raises(ValueError, match="multiple of KV heads"):
        window_scores(torch.randn(1, 3, 3, 16), k, qp, kp)
    with pytest.raises(ValueError, match="disagree on batch or head_dim"):
        window_scores(q, torch.randn(1, 2, 10, 8), qp, kp)
    with pytest.raises(ValueError, match="q_pos must be"):
        window_scores(q, k, qp[:, :2], kp)
    with pytest.raises(ValueError, match="floating point"):
        window_scores(q.long(), k, qp, kp)
    with pytest.raises(ValueError, match="integer"):
        window_scores(q, k, qp.float(), kp)
    with pytest.raises(ValueError, match="sliding window"):
        window_scores(q, k, qp, kp, sliding_window=0)


def test_compact_kv_bad_input():
    B, H, N, D, C = 1, 2, 10, 4, 5
    k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    kc, vc = torch.zeros(B, H, C, D), torch.zeros(B, H, C, D)
    pc, kp = torch.full((B, H, C), -1), torch.arange(N)[None]

    def call(idx, **kw):
        compact_kv(kw.get("kc", kc), vc, pc, k, v, kp, idx)

    with pytest.raises(ValueError, match="strictly increasing"):
        call(torch.tensor([[[0, 3, 2], [1, 2, 3]]]))
    with pytest.raises(ValueError, match="strictly increasing"):
        call(torch.tensor([[[0, 3, 3], [1, 2, 3]]]))
    with pytest.raises(ValueError, match="only appear at the end"):
        call(torch.tensor([[[0, -1, 3], [1, 2, 3]]]))
    with pytest.raises(ValueError, match="must be < N"):
        call(torch.tensor([[[0, 3, 10], [1, 2, 3]]]))
    with pytest.raises(ValueError, match="do not fit a cache of capacity 5"):
        call(torch.arange(6).expand(1, 2, 6).contiguous())
    with pytest.raises(ValueError, match="int64"):
        call(torch.tensor([[[0, 1], [1, 2]]], dtype=torch.int32))
    with pytest.raises(ValueError, match="caches must be"):
        call(torch.tensor([[[0, 1], [1, 2]]]), kc=torch.zeros(B, H, C, D + 1))


@pytest.mark.parametrize("S,sliding_window", [(1, 4), (7, 4), (8, 4), (19, 5)])
def test_sliding_window_attention_op(S, sliding_window):
    """Blockwise sliding attention equals masked full attention, and the op registers cleanly."""
    import torch.nn.functional as F

    from structkv.ops import visible

    g = torch.Generator().manual_seed(S)
    q = torch.randn(2, 4, S, 8, generator=g)
    k, v = torch.randn(2, 2, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g)
    pos = torch.arange(S).expand(2, S).clone()
    pos[1, : S // 3] = -1  # left padding in row 1
    out = torch.ops.structkv.sliding_window_attention(q, k, v, pos, sliding_window, 0.3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible(pos, pos, sliding_window), scale=0.3,
                                         enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-5)
    torch.library.opcheck(torch.ops.structkv.sliding_window_attention.default, (q, k, v, pos, sliding_window, 0.3))


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 60), sliding_window=st.integers(1, 12), block=st.integers(1, 9), pad=st.integers(0, 5),
       gaps=st.booleans(), seed=st.integers(0, 2**16))
def test_sliding_blocks_equal_one_masked_call(S, sliding_window, block, pad, gaps, seed):
    """Sliding attention in blocks of any size equals one masked call over every key, for left
    padding and for a kept subset of a prompt (increasing positions with gaps)."""
    import torch.nn.functional as F

    from structkv.ops import visible
    from structkv.ops.attention import sliding_self_attention

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, S, 8, generator=g)
    k, v = torch.randn(2, 2, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g)
    step = torch.randint(1, 4, (2, S), generator=g) if gaps else torch.ones(2, S, dtype=torch.long)
    pos = step.cumsum(1) - 1  # (2, S) increasing
    pos[1, : min(pad, S - 1)] = -1  # left padding in row 1 (one valid token kept)
    out = sliding_self_attention(q, k, v, pos, sliding_window, 0.3, block)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible(pos, pos, sliding_window), scale=0.3,
                                         enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("S,block", [(5, 4), (16, 4), (19, 5), (40, 64)])
def test_causal_attention_op_blocks_equal_one_masked_call(S, block, padded):
    """Query blocks over the keys up to each block's end equal one masked call, for left padding and
    for a token subset with gaps in its positions (what propagation feeds deeper layers)."""
    import torch.nn.functional as F

    from structkv.ops import visible

    g = torch.Generator().manual_seed(S)
    q = torch.randn(2, 4, S, 8, generator=g)
    k, v = torch.randn(2, 2, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g)
    pos = (torch.arange(S) * 3 + 1).expand(2, S).clone()  # gaps: a kept subset of a longer prompt
    if padded:
        pos[1, : S // 3] = -1  # left padding in row 1 (blocked masked path); else the causal path
    out = torch.ops.structkv.causal_attention(q, k, v, pos, 0.3, block)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible(pos, pos, None), scale=0.3, enable_gqa=True)
    valid = pos[:, None, :, None] >= 0  # padded queries see nothing: undefined either way
    assert torch.allclose(torch.where(valid, out, 0), torch.where(valid, ref, 0), atol=1e-5)
    torch.library.opcheck(torch.ops.structkv.causal_attention.default, (q, k, v, pos, 0.3, block))


@st.composite
def decode_case(draw):
    """One decode query over a cache whose key ranges may be wholly hidden (empty slots, another
    head's mask): the split attention must give them no weight."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    B, hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 4]))
    D, T = draw(st.sampled_from([32, 64, 256])), 64 * draw(st.integers(1, 12))
    per_head = draw(st.booleans())
    mask = torch.rand(B, hkv if per_head else 1, 1, T, generator=g) < draw(st.floats(0.05, 1.0))
    hidden = draw(st.integers(0, T - 1))  # a leading run of empty slots, as a half-filled cache has
    mask[..., :hidden] = False
    mask[..., -1] = True  # the token just written is always visible
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((hkv * G, 1), (hkv, T), (hkv, T)))
    return q, k, v, mask


@given(decode_case(), st.integers(1, 8))
def test_split_decode_attention_equals_one_call(case, threads):
    from structkv.ops.attention import SPLIT_BYTES, decode_attention, decode_splits, split_decode_attention

    q, k, v, mask = case
    want = decode_attention(q, k, v, mask, 0.125)
    splits = decode_splits(k, threads)
    assert splits == 1 or (k.shape[2] % splits == 0 and splits <= 2 * threads
                           and 2 * k.numel() * 4 // splits >= SPLIT_BYTES)
    for s in {2, 4, splits} - {1}:
        if k.shape[2] % s == 0:
            torch.testing.assert_close(split_decode_attention(q, k, v, mask, 0.125, s), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode_attention(q, k, v, mask, 0.125, threads), want, rtol=1e-5, atol=1e-5)


def test_decode_splits_only_for_long_caches_on_several_cpu_threads():
    from structkv.ops.attention import decode_splits

    long, short = torch.empty(1, 1, 4352, 256), torch.empty(1, 1, 512, 256)  # 8.9 MB and 1 MB of k + v
    assert decode_splits(long, 1) == 1 and decode_splits(short, 2) == 1
    assert decode_splits(long, 2) == 4 and decode_splits(long, 16) == 8  # ranges of >= 1 MiB
    assert decode_splits(torch.empty(1, 3, 4544, 64), 2) == 4  # SmolLM2's 3 KV heads at 4.5K slots


def test_generation_with_split_decode_attention_keeps_its_tokens(tiny_dir, monkeypatch):
    """Eager and compiled decode over a cache split in key ranges give the unsplit tokens (the SDPA
    path, what caches run where the CPU decode kernel is not built)."""
    import structkv
    import structkv.ops.attention as attention
    from structkv.ops import cpu_decode

    monkeypatch.setattr(cpu_decode, "available", lambda: False)

    model = structkv.load(tiny_dir("llama"))
    ids = torch.randint(3, 96, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    want = structkv.generate(model, ids, max_new_tokens=6, stop_at_eos=False, compile=False).token_ids
    calls = []
    split = attention.split_decode_attention
    monkeypatch.setattr(attention, "split_decode_attention", lambda *a: calls.append(a[-1]) or split(*a))
    monkeypatch.setattr(attention, "SPLIT_BYTES", 1024)  # the tiny cache's ranges count as long
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # read by each cache when made
    for compile in (False, True):
        calls.clear()
        out = structkv.generate(model, ids, max_new_tokens=6, stop_at_eos=False, compile=compile)
        assert out.token_ids == want and calls and set(calls) <= {2, 4}
