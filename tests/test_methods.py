"""StructKV and the baselines: exactness against references, pruning invariants, bad input."""
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.models import StaticKVCache
from structkv.modules import (
    CentralityTracker,
    PivotDetector,
    SkeletonPruner,
    calibrate_pivot,
    candidate_layers,
    select_tokens,
)
from structkv.ops import visible
from structkv.runtime.compress import compress
from structkv.text.prompts import encode_batch

FULL_BUDGET = {"kv_budget": 1.0, "struct_budget": 1.0}


def _ids(n, seed=0):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _full_options(name):
    fields = {f for f in methods.get(name).describe()}
    return {k: v for k, v in FULL_BUDGET.items()
            if k in fields and not (name == "structkv_coupled" and k == "struct_budget")}


def _compress(model, ids, method, room=16):
    tokens, positions, _ = encode_batch(model, [ids] if isinstance(ids[0], int) else ids)
    return compress(model, tokens, positions, method, room=room)


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return structkv.load(tiny_dir("llama"))


@pytest.fixture(scope="module")
def gemma_tiny(tiny_dir):
    return structkv.load(tiny_dir("gemma3_text"))


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("name", methods.names())
def test_budget_at_prompt_length_is_identity(arch, name, tiny_dir):
    model = structkv.load(tiny_dir(arch))
    ids = _ids(64)
    method = methods.get(name, **_full_options(name))
    ref_logits = model(torch.tensor([ids]))[:, -1]
    state = _compress(model, ids, method)
    assert torch.allclose(state.logits, ref_logits, atol=1e-5)
    full = structkv.generate(model, ids, max_new_tokens=10, stop_at_eos=False, compile=False)
    out = structkv.generate(model, ids, max_new_tokens=10, stop_at_eos=False, compile=False, method=method)
    assert out.token_ids == full.token_ids


def _same_cache(a, b):
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(la.pos, lb.pos)
        assert torch.allclose(la.k, lb.k, atol=1e-6) and torch.allclose(la.v, lb.v, atol=1e-6)


def test_fastkv_with_tsp_rate_1_equals_snapkv(llama):
    ids = _ids(90)
    fast = _compress(llama, ids, methods.FastKV(kv_budget=0.2, struct_budget=1.0, tsp_layer=1))
    snap = _compress(llama, ids, methods.SnapKV(kv_budget=0.2))
    _same_cache(fast, snap)
    assert torch.allclose(fast.logits, snap.logits, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_structkv_lambda0_fixed_pivot_equals_fastkv(arch, tiny_dir):
    model = structkv.load(tiny_dir(arch))
    p = model.config.full_attention_layers[0]
    ids = _ids(100, seed=3)
    sk = _compress(model, ids, methods.StructKV(pivot=p, decay=0.0, struct_budget=0.3, kv_budget=0.2, beta=0.0,
                                                skeleton="centrality"))
    fk = _compress(model, ids, methods.FastKV(tsp_layer=p, struct_budget=0.3, kv_budget=0.2))
    assert torch.equal(sk.kept_columns, fk.kept_columns)
    _same_cache(sk, fk)
    assert torch.allclose(sk.logits, fk.logits, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("options", [{"guide": "pivot"}, {"guide": "centrality"}, {"skeleton": "union"},
                                     {"skeleton": "pivot"}, {"equal_compute": True}])
def test_structkv_options_keep_exact_budgets_and_the_window(arch, options, tiny_dir):
    """Every StructKV option: each planned layer keeps exactly its budget per KV head, the window
    among it; guided retention with beta=0 is the plain method; a pivot-only skeleton with decay 0
    is the centrality skeleton."""
    model = structkv.load(tiny_dir(arch))
    ids = _ids(120, seed=4)
    p = model.config.full_attention_layers[0]
    method = methods.StructKV(kv_budget=0.2, struct_budget=0.3, beta=3.0, pivot=p, **options)
    state = _compress(model, ids, method)
    keep = method.kv_keep(torch.tensor([120]))[0]
    for i in model.config.full_attention_layers:
        layer = state.cache.layers[i]
        pos = layer.pos[0]  # (Hkv, capacity)
        assert ((pos >= 0).sum(-1) == keep).all()
        for h in range(pos.shape[0]):
            assert set(range(112, 120)) <= set(pos[h][pos[h] >= 0].tolist())  # window kept
    plain = _compress(model, ids, methods.StructKV(kv_budget=0.2, struct_budget=0.3, pivot=p, beta=0.0,
                                                   **{k: v for k, v in options.items() if k != "guide"}))
    zero = _compress(model, ids, methods.StructKV(kv_budget=0.2, struct_budget=0.3, pivot=p,
                                                  **{**options, "beta": 0.0}))
    _same_cache(plain, zero)


def test_guided_retention_changes_what_early_layers_keep(llama):
    """With beta > 0 the layers before the pivot are chosen after it, with the pivot's saliency:
    they differ from the plain method's, the layers' sizes do not, and an enormous beta makes
    every layer keep nearly the pivot layer's own choice (max-pooled ties are broken by each
    layer's own scores)."""
    ids = _ids(150, seed=6)
    plain = _compress(llama, ids, methods.StructKV(kv_budget=0.2, pivot=2, beta=0.0))
    guided = _compress(llama, ids, methods.StructKV(kv_budget=0.2, pivot=2, beta=1e6))
    assert plain.stats["kv_entries_per_layer"] == guided.stats["kv_entries_per_layer"]
    assert any(not torch.equal(a.pos, b.pos) for a, b in zip(plain.cache.layers[:2], guided.cache.layers[:2]))
    def overlap(a, b):  # kept positions shared by two layers, over all KV heads
        same = [len(set(x[x >= 0].tolist()) & set(y[y >= 0].tolist())) / (x >= 0).sum().item()
                for x, y in zip(a.pos[0], b.pos[0])]
        return sum(same) / len(same)
    layers = guided.cache.layers
    assert overlap(layers[0], layers[2]) > 0.9 and overlap(layers[1], layers[2]) > 0.9  # ties (pooled) aside
    assert overlap(plain.cache.layers[0], plain.cache.layers[2]) < overlap(layers[0], layers[2])


def test_equal_compute_matches_fastkv_prefill(llama):
    """equal_compute: at any pivot the skeleton is sized so that token-layers match FastKV's."""
    ids = _ids(200, seed=7)
    fast = _compress(llama, ids, methods.FastKV(kv_budget=0.2, struct_budget=0.2))
    for p in (0, 1):
        sk = _compress(llama, ids, methods.StructKV(kv_budget=0.2, struct_budget=0.2, pivot=p, equal_compute=True))
        assert sk.stats["prefill_fraction"] == pytest.approx(fast.stats["prefill_fraction"], abs=3 / 200)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_propagation_equals_restricted_attention_reference(arch, tiny_dir):
    """After the pivot, kept tokens compute exactly what the full sequence computes with
    attention restricted to the kept keys."""
    model = structkv.load(tiny_dir(arch))
    p = model.config.full_attention_layers[0]
    ids = _ids(80, seed=5)
    state = _compress(model, ids, methods.StructKV(pivot=p, struct_budget=0.25, kv_budget=1.0))
    kept = state.kept_columns[0]
    kept = kept[kept >= 0]
    assert 0 < len(kept) < 80 and kept[-1] == 79
    pos = torch.arange(80)[None]
    h, rope = model.embed(torch.tensor([ids])), model.rope_tables(pos)
    restricted = torch.full_like(pos, -1)
    restricted[0, kept] = kept
    for i, block in enumerate(model.model.layers):  # plain reference: the block's parts, keys masked after p
        attn, (cos, sin) = block.self_attn, rope[model.config.layer_types[i]]
        q, k, v = attn.qkv(block.input_layernorm(h), cos, sin)
        h = block.finish(h, attn.attend(q, k, v, visible(pos, restricted if i > p else pos, attn.sliding_window)))
    assert torch.allclose(state.logits, model.logits(h[:, -1]), atol=1e-5)


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "streaming_llm", "h2o"])
def test_decode_over_compacted_cache_equals_masked_full_cache(name, gemma_tiny):
    model = gemma_tiny
    ids = _ids(70, seed=7)
    state = _compress(model, ids, methods.get(name, kv_budget=0.3))
    tokens, positions, _ = encode_batch(model, [ids])
    full = StaticKVCache(model.config, 1, 128, model.dtype, model.device)
    _, kv = model.prompt_pass(tokens, positions)
    for layer, small, (k, v) in zip(full.layers, state.cache.layers, kv):
        layer.fill(k, v, positions)
        if small.sliding_window is None:  # drop, per KV head, every position the compressed cache lacks
            for h in range(layer.pos.shape[1]):
                keep = set(small.pos[0, h][small.pos[0, h] >= 0].tolist())
                layer.pos[0, h] = torch.tensor([p if p in keep else -1 for p in layer.pos[0, h].tolist()])
    cache = state.cache.clone()
    for step, tok in enumerate([11, 23, 5]):
        pos = torch.tensor([[70 + step]])
        ours = model.decode_step(torch.tensor([[tok]]), pos, cache)
        ref = model.decode_step(torch.tensor([[tok]]), pos, full)
        assert torch.allclose(ours, ref, atol=1e-5)


def test_kept_positions_are_original_positions(llama):
    ids = _ids(90, seed=2)
    state = _compress(llama, ids, methods.StructKV(pivot=1, struct_budget=0.3, kv_budget=0.15))
    for layer in state.cache.layers:
        for h in range(layer.pos.shape[1]):
            p = layer.pos[0, h][layer.pos[0, h] >= 0]
            assert len(p) == int(90 * 0.15) or len(p) <= int(90 * 0.3)  # budget, or all skeleton tokens
            assert torch.equal(p, p.unique()) and int(p.max()) == 89  # sorted, unique, window kept
    assert state.next_positions.item() == 90


# ---------------------------------------------------------------------------- hybrid models
def test_hybrid_sliding_layers_keep_exact_window(gemma_tiny):
    cfg = gemma_tiny.config
    state = _compress(gemma_tiny, _ids(60), methods.StructKV(kv_budget=0.2, struct_budget=0.4))
    for i, layer in enumerate(state.cache.layers):
        if cfg.sliding_window_at(i) is not None:
            assert layer.sliding_window == cfg.sliding_window_at(i) and layer.capacity == cfg.sliding_window_at(i)
    assert set(state.stats["centrality_layers"]) <= set(cfg.full_attention_layers)
    assert state.stats["pivot_layer"] in cfg.full_attention_layers
    full_entries = [state.stats["kv_entries_per_layer"][i] for i in cfg.full_attention_layers]
    assert all(e <= int(60 * 0.2) * cfg.num_kv_heads for e in full_entries)


# ---------------------------------------------------------------------------- batches and states
@pytest.mark.parametrize("name", ["snapkv", "fastkv", "structkv", "gemfilter", "pyramidkv"])
def test_batch_rows_are_independent(name, llama):
    prompts = [_ids(90, seed=1), _ids(61, seed=2)]
    method = methods.get(name, kv_budget=0.25)
    batch = structkv.generate(llama, prompts, max_new_tokens=8, stop_at_eos=False, compile=False, method=method)
    for p, got in zip(prompts, batch.token_ids):
        alone = structkv.generate(llama, p, max_new_tokens=8, stop_at_eos=False, compile=False, method=method)
        assert got == alone.token_ids


def test_compress_once_ask_many(llama):
    context, q1, q2 = _ids(80, seed=1), _ids(6, seed=8), _ids(9, seed=9)
    state = structkv.prefill(llama, context, methods.StructKV(kv_budget=0.2), room=64)
    a1 = structkv.generate(llama, q1, state=state, max_new_tokens=6, stop_at_eos=False, compile=False)
    a2 = structkv.generate(llama, q2, state=state, max_new_tokens=6, stop_at_eos=False, compile=False)
    again = structkv.generate(llama, q1, state=state, max_new_tokens=6, stop_at_eos=False, compile=False)
    assert again.token_ids == a1.token_ids and len(a2.token_ids) == 6  # the state is not consumed
    # with the full method, context + question from a state equals the plain prompt
    full_state = structkv.prefill(llama, context, methods.Full(), room=64)
    via_state = structkv.generate(llama, q1, state=full_state, max_new_tokens=6, stop_at_eos=False, compile=False)
    plain = structkv.generate(llama, context + q1, max_new_tokens=6, stop_at_eos=False, compile=False)
    assert via_state.token_ids == plain.token_ids


@pytest.mark.parametrize("name", ["structkv", "structkv_paper"])
def test_compiled_decode_from_budgeted_cache(llama, name):
    method = methods.get(name, kv_budget=0.2)
    eager = structkv.generate(llama, _ids(70), max_new_tokens=8, stop_at_eos=False, compile=False, method=method)
    comp = structkv.generate(llama, _ids(70), max_new_tokens=8, stop_at_eos=False, compile=True, method=method)
    assert comp.token_ids == eager.token_ids
    assert eager.stats["prefill_fraction"] < 1.0
    assert ("t_curve" in eager.stats) == (name == "structkv_paper")  # the paper's detects its pivot


# ---------------------------------------------------------------------------- invariants
@st.composite
def selection_case(draw):
    seed = draw(st.integers(0, 2**16))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n = draw(st.integers(4, 60))
    window = draw(st.integers(0, 4))
    lens = [draw(st.integers(max(window, 1), n)) for _ in range(B)]
    keep = [draw(st.integers(max(window, 1), n + 5)) for _ in range(B)]
    ties = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (B, H, n), generator=g).float() if ties else torch.rand(B, H, n, generator=g)
    valid = torch.stack([torch.arange(n) >= n - length for length in lens])
    scores = torch.where(valid[:, None], scores, torch.rand(B, H, n, generator=g) * 100)  # padding scores high
    return scores, valid, keep, window, lens


@given(selection_case())
def test_selection_invariants(case):
    scores, valid, keep, window, lens = case
    idx = select_tokens(scores, valid, keep, window)
    B, H, n = scores.shape
    for b in range(B):
        for h in range(H):
            row = idx[b, h]
            kept = row[row >= 0]
            assert (row[: len(row) - len(kept)] == -1).all()  # padding on the left only
            assert torch.equal(kept, kept.unique())  # sorted, unique
            assert len(kept) == min(keep[b], lens[b])  # budget met exactly
            assert valid[b, kept].all()  # padding never selected
            win = torch.arange(n - min(window, lens[b]), n)
            assert set(win.tolist()) <= set(kept.tolist())  # the window is always kept
            cand = valid[b] & (torch.arange(n) < n - window)
            chosen = torch.zeros(n, dtype=torch.bool)
            chosen[kept] = True
            dropped = cand & ~chosen
            picked = cand & chosen
            if dropped.any() and picked.any():
                lo = scores[b, h][picked].min()
                assert lo >= scores[b, h][dropped].max()  # kept scores dominate dropped ones
                tie = scores[b, h] == lo
                # ties go to the earlier token: no dropped tie precedes a kept tie
                assert not (dropped & tie).nonzero().numel() or \
                    (dropped & tie).nonzero().min() > (picked & tie).nonzero().max()
        alone = select_tokens(scores[b:b + 1, :, n - lens[b]:], valid[b:b + 1, n - lens[b]:], [keep[b]], window)
        kept_alone = alone[0][alone[0] >= 0] + (n - lens[b])
        assert torch.equal(kept_alone, idx[b][idx[b] >= 0].view(H, -1).reshape(-1))  # rows independent


def test_centrality_equals_closed_form_through_subsetting():
    tr = CentralityTracker(decay=0.5)
    tr.reset(1, 6)
    s0 = torch.tensor([[1.0, 2, 3, 4, 5, 6]])
    tr.update(s0, torch.arange(6)[None])
    s1 = torch.tensor([[10.0, 20, 30]])
    cols = torch.tensor([[1, 3, 5]])  # a subset survives
    tr.update(s1, cols)
    expected = 0.5 * s0
    expected[0, cols[0]] += s1[0]
    assert torch.allclose(tr.value, expected) and torch.allclose(tr.current(cols), expected[:, [1, 3, 5]])


def test_centrality_decays_by_layer_distance():
    """The paper's C = sum_l decay^(L*-l) S^(l) on a hybrid's scored layers 5 and 11: decay^6 S5 + S11."""
    tr = CentralityTracker(decay=0.9)
    tr.reset(1, 4)
    s5, s11 = torch.tensor([[1.0, 2, 3, 4]]), torch.tensor([[4.0, 3, 2, 1]])
    tr.update(s5, torch.arange(4)[None], layer=5)
    tr.update(s11, torch.arange(4)[None], layer=11)
    assert torch.allclose(tr.value, 0.9 ** 6 * s5 + s11)
    with pytest.raises(ValueError, match="increasing order"):
        tr.update(s5, torch.arange(4)[None], layer=11)


def test_skeleton_pruner_positions():
    scores = torch.tensor([[5.0, 0, 4, 1, 0, 0]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    h = torch.arange(6.0).view(1, 6, 1)
    pos = torch.arange(10, 16)[None]
    orig = SkeletonPruner(window=2)
    idx = orig.select(scores, valid, [4])
    assert idx.tolist() == [[0, 2, 4, 5]]
    (h2, p2) = orig.gather(idx, h, positions=pos)
    assert p2.tolist() == [[10, 12, 14, 15]] and h2[0, :, 0].tolist() == [0, 2, 4, 5]
    (_, p3) = SkeletonPruner(window=2, positions="compact").gather(idx, h, positions=pos)
    assert p3.tolist() == [[0, 1, 2, 3]]


def _fire(det, H, rows=1):
    fired_at = [None] * rows
    for layer, h in enumerate(H):
        stats = torch.tensor([[h, 0.1, 0.01]] * rows)
        for b, f in enumerate(det.observe(layer, stats)):
            if f:
                fired_at[b] = layer
    return fired_at


def test_pivot_fires_after_a_confirmed_peak_and_is_forced_at_range_end():
    """Entropy falls a little into layer 3, then sharply into 5: the first dip (after 3) is not
    the transition. confirm=1 (the paper's argmax + 1) fires at 4; confirm=2 waits for the peak
    to hold two layers and fires at 7, after the real peak at 5. Flat rows fire at the range end."""
    H = [1.0, 0.98, 0.96, 0.9, 0.89, 0.5, 0.48, 0.47, 0.46, 0.45]
    det = PivotDetector(num_layers=10, scored_layers=list(range(10)), depth_range=(0.3, 0.8), confirm=1)
    assert det.candidates == [3, 4, 5, 6, 7, 8]
    det.reset(1)
    assert _fire(det, H) == [4]
    det = PivotDetector(num_layers=10, scored_layers=list(range(10)), depth_range=(0.3, 0.8), confirm=2)
    det.reset(2)
    fired = [None, None]
    for layer, h in enumerate(H):
        for b, f in enumerate(det.observe(layer, torch.tensor([[h, 0.1, 0.01], [0.9, 0.1, 0.01]]))):
            fired[b] = layer if f else fired[b]
    assert fired == [7, 8]
    curve = det.traces[0].t_curve
    assert max(curve, key=curve.get) == 5 and min(curve) == 3  # the curve starts one layer before the range
    assert calibrate_pivot(det.traces[:1], det.candidates) == 6
    assert calibrate_pivot(det.traces[:1], det.candidates, confirm=2) == 7


def test_pivot_statistics_leave_out_sink_and_window():
    """Only ranked columns count: attention on the first tokens (the sink) or on the window does
    not move H, rho or V; the changes are normalised by each statistic's spread."""
    from structkv.modules.pivot import ranked_mask, transition_curve

    g = torch.Generator().manual_seed(0)
    sal = torch.rand(1, 2, 40, generator=g)
    pos = torch.arange(40)[None]
    ranked = ranked_mask(pos, 8, 4)
    assert ranked[0, :4].sum() == 0 and ranked[0, -8:].sum() == 0 and ranked[0, 4:32].all()
    moved = sal.clone()
    moved[..., :4] *= 50
    moved[..., -8:] *= 50
    a, b = (PivotDetector.statistics(x, ranked, 0.1) for x in (sal, moved))
    assert torch.allclose(a, b)
    uniform = PivotDetector.statistics(torch.ones(1, 2, 40), ranked, 0.1)[0]
    assert uniform[0] == pytest.approx(1.0) and uniform[2] == pytest.approx(0.0, abs=1e-9)
    curve = transition_curve({0: (1.0, 0.1, 0.0), 1: (0.5, 0.1, 0.0), 2: (0.25, 0.1, 0.0)}, (1.0, 0.0, 0.0))
    assert curve == pytest.approx({1: 2 / 3, 2: 1 / 3}, rel=1e-6)  # -dH over H's spread 0.75


def test_candidate_layers_on_hybrid_models():
    assert candidate_layers(18, [5, 11, 17]) == [11]  # Gemma 3 270M: no full layer in 0.3L..0.6L
    assert candidate_layers(32, list(range(32))) == list(range(10, 20))


# ---------------------------------------------------------------------------- bad input
def test_bad_budgets_and_names(llama):
    for bad in (0.0, 1.5, -3, 0):
        with pytest.raises(ValueError, match="kv_budget"):
            methods.SnapKV(kv_budget=bad)
    with pytest.raises(ValueError, match="below the observation window"):
        methods.SnapKV(kv_budget=4)
    with pytest.raises(ValueError, match="unknown method 'snap'.*valid: full, streaming_llm, snapkv"):
        methods.get("snap")
    with pytest.raises(ValueError, match="unknown option\\(s\\) \\['budget'\\].*valid"):
        methods.get("fastkv", budget=0.1)
    with pytest.raises(ValueError, match="pivot must be 'dynamic'"):
        methods.StructKV(pivot="auto")
    with pytest.raises(ValueError, match="calibrate"):
        methods.StructKV(pivot="calibrated")
    for bad in ({"beta": -1.0}, {"skeleton": "best"}, {"guide": "c"}, {"confirm": 0}, {"topk_ratio": 0.0}):
        with pytest.raises(ValueError, match=f"structkv: {next(iter(bad))}"):
            methods.StructKV(**bad)



SHORT_PROMPT_METHODS = {"streaming_llm": {}, "snapkv": {}, "pyramidkv": {}, "h2o": {}, "gemfilter": {},
                        "fastkv": {"tsp_layer": 1}, "structkv": {"pivot": 1}}


@pytest.mark.parametrize("name", list(SHORT_PROMPT_METHODS))
@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_short_prompts_keep_their_window(llama, name, n):
    """The rule for short prompts: every row keeps at least one token and its observation window,
    the whole prompt when it is shorter (a ratio budget that floors below it is raised to it)."""
    method = methods.get(name, kv_budget=0.1, **SHORT_PROMPT_METHODS[name])
    state = _compress(llama, _ids(n), method)
    entries = state.stats["kv_entries_per_layer"]
    window = getattr(method, "window", 0)
    kv_heads = llama.config.num_kv_heads
    assert all(e >= kv_heads * max(1, min(window, n)) for e in entries), entries
    assert torch.isfinite(state.logits).all()
    out = structkv.generate(llama, _ids(n), method=method, max_new_tokens=3, compile=False)
    assert len(out.token_ids) >= 1
    if n <= window:  # nothing to choose from: identical to the full cache
        full = structkv.generate(llama, _ids(n), max_new_tokens=3, compile=False, stop_at_eos=False)
        assert structkv.generate(llama, _ids(n), method=method, max_new_tokens=3, compile=False,
                                 stop_at_eos=False).token_ids == full.token_ids


def test_ratio_below_the_window_is_raised_to_it(llama):
    state = _compress(llama, _ids(40), methods.SnapKV(kv_budget=0.1))  # floor(4) < window 8
    assert set(state.stats["kv_entries_per_layer"]) == {8 * llama.config.num_kv_heads}


@given(n=st.integers(1, 120), budget=st.sampled_from([0.05, 0.1, 0.2, 0.5, 1.0, 9, 40]),
       name=st.sampled_from(["full", "streaming_llm", "snapkv", "pyramidkv", "h2o"]),
       arch=st.sampled_from(["llama", "gemma3_text"]))
def test_planned_kept_entries_equal_what_compress_keeps(tiny_dir, n, budget, name, arch):
    """Methods without propagation know their kept entries from the length alone (the accounting
    of results recorded before kept bytes were): equal to what the prefill keeps, per layer."""
    model = structkv.load(tiny_dir(arch))
    method = methods.get(name) if name == "full" else methods.get(name, kv_budget=budget)
    planned = _kept_bytes().planned_kv_entries(method, model.config, n)
    assert planned == _compress(model, _ids(n), method).stats["kv_entries_per_layer"]


@pytest.mark.parametrize("name", ["gemfilter", "fastkv", "structkv", "structkv_paper"])
def test_propagating_methods_have_no_planned_kept_entries(llama, name):
    assert _kept_bytes().planned_kv_entries(methods.get(name), llama.config, 100) is None


def _kept_bytes():
    """benchmarks/kept_bytes.py, where the planned count lives (it backfills old result records)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kept_bytes.py"
    spec = importlib.util.spec_from_file_location("kept_bytes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, options, message", [
    ("snapkv", {"window": 0}, "window must be an int >= 1"),
    ("pyramidkv", {"window": 0}, "window must be an int >= 1"),
    ("fastkv", {"window": 0}, "window must be an int >= 1"),
    ("structkv", {"window": 0}, "window must be an int >= 1"),
    ("snapkv", {"window": -1}, "window must be an int"),
    ("snapkv", {"window": 2.5}, "window must be an int"),
    ("pyramidkv", {"beta": 0.5}, "beta must be a finite number >= 1"),
    ("pyramidkv", {"beta": float("nan")}, "beta must be a finite number >= 1"),
    ("pyramidkv", {"beta": float("inf")}, "beta must be a finite number >= 1"),
    ("gemfilter", {"kernel": 0}, "kernel must be a positive int"),
    ("gemfilter", {"kernel": 2.0}, "kernel must be a positive int"),
    ("snapkv", {"kernel": -7}, "kernel must be a positive int"),
    ("structkv", {"weights": (0.2, 0.3)}, "weights must be three finite numbers"),
    ("structkv", {"weights": (0.2, float("nan"), 0.5)}, "weights must be three finite numbers"),
    ("structkv", {"weights": (0, 0, 0)}, "weights must be three finite numbers"),
    ("structkv", {"weights": (-1, 1, 1)}, "weights must be three finite numbers"),
    ("structkv", {"depth_range": (0.6, 0.3)}, "depth_range must be two fractions"),
    ("structkv", {"kv_budget": float("nan")}, "kv_budget ratio must be in"),
    ("structkv_coupled", {"kv_budget": float("nan")}, "kv_budget ratio must be in"),
    ("structkv_coupled", {"kv_budget": 0.1, "struct_budget": 0.2}, "ties struct_budget to kv_budget"),
])
def test_degenerate_options_are_refused(name, options, message):
    with pytest.raises(ValueError, match=message):
        methods.get(name, **options)


def test_sliding_layer_rejected_as_tsp_layer(gemma_tiny):
    with pytest.raises(ValueError, match="sliding-window layer; choose one of the full-attention layers"):
        _compress(gemma_tiny, _ids(60), methods.FastKV(tsp_layer=0, kv_budget=0.3))


def test_compiled_blocks_equal_eager_and_compile_once(llama, gemma_tiny):
    """Compressed prefill with compiled layer blocks: same result as eager, and one graph per
    layer kind serves every length, before and after propagation."""
    from torch._dynamo.testing import CompileCounterWithBackend

    for model in (llama, gemma_tiny):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        kinds = len(set(model.config.layer_types))
        for n, seed in ((70, 1), (93, 2), (120, 3)):
            method = methods.StructKV(kv_budget=0.2, struct_budget=0.3)
            eager = _compress(model, _ids(n, seed), method)
            tokens, positions, _ = encode_batch(model, [_ids(n, seed)])
            comp = compress(model, tokens, positions, method, room=16, compile=counter)
            assert torch.allclose(comp.logits, eager.logits, atol=1e-4)
            assert torch.equal(comp.kept_columns, eager.kept_columns)
        assert counter.frame_count <= kinds


def test_shared_selection_is_the_same_for_every_head(llama):
    state = _compress(llama, _ids(90), methods.SnapKV(kv_budget=0.2, per_head=False))
    per_head = _compress(llama, _ids(90), methods.SnapKV(kv_budget=0.2))
    for shared_layer, head_layer in zip(state.cache.layers, per_head.cache.layers):
        assert (shared_layer.pos == shared_layer.pos[:, :1]).all()
    assert any(not (layer.pos == layer.pos[:, :1]).all() for layer in per_head.cache.layers)


@pytest.mark.parametrize("block", [16, 1024])
def test_h2o_received_attention_equals_the_definition(block):
    """Causal query blocks read only the keys before their end; the sum equals the full softmax
    (every query against every key, masked) summed over queries and group heads."""
    from structkv.modules import received_attention
    from structkv.ops.saliency import window_scores_naive

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, n, D = 2, 4, 2, 70, 8
    q, k = torch.randn(B, Hq, n, D, generator=g), torch.randn(B, Hkv, n, D, generator=g)
    pos = torch.arange(n).expand(B, n).clone()
    pos[1, :9] = -1  # left padding
    pos[1, 9:] -= 9
    mine = received_attention(q, k, pos, 0.35, block=block)
    ref = window_scores_naive(q, k, pos, pos, 0.35)[0] * n  # mean over the n queries -> sum
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


def test_calibrate_fixes_the_pivot_from_prompts(llama):
    """calibrate: the detector sees every scored layer of each prompt (statistics over the whole
    depth, T over the candidate range) and the method comes back with a fixed candidate pivot."""
    method = methods.get("structkv_paper", kv_budget=0.2, depth_range=(0.3, 0.7))
    fixed, traces = structkv.calibrate(llama, [_ids(80, 1), _ids(60, 2)], method)
    assert len(traces) == 2 and all(sorted(t.stats) == [0, 1, 2] for t in traces)
    assert fixed.pivot in (1, 2) and fixed.name == "structkv_paper" and fixed.kv_budget == 0.2
    state = _compress(llama, _ids(80, 1), fixed)
    assert state.stats["pivot_layer"] == fixed.pivot
    with pytest.raises(TypeError, match="StructKV"):
        structkv.calibrate(llama, [_ids(10)], methods.SnapKV())


@pytest.mark.parametrize("options", [{"observe": 32}, {"pool_query_heads": True}, {"pyramid": 20.0}])
def test_scoring_and_budget_options_keep_their_invariants(llama, options):
    """A 32-query observation window with 8 forced, per-query-head pooling and pyramid budgets:
    planned layers keep exactly their budget (the pyramid's per-layer budgets sum to the flat
    total), always with the forced window; each option at its neutral setting is the plain method."""
    ids = _ids(160, seed=8)
    method = methods.StructKV(kv_budget=0.2, pivot=2, **options)
    state = _compress(llama, ids, method)
    lengths = torch.tensor([160])
    plan = method.kv_plan(llama.config, lengths)
    for i, layer in enumerate(state.cache.layers):
        pos = layer.pos[0]
        assert ((pos >= 0).sum(-1) == plan[i][0]).all()
        assert all(set(range(152, 160)) <= set(h[h >= 0].tolist()) for h in pos)
    flat = method.kv_keep(lengths)[0] * len(plan)
    assert abs(sum(p[0] for p in plan.values()) - flat) <= len(plan)
    neutral = {"observe": {"observe": 8}, "pool_query_heads": {"pool_query_heads": True, "pooling": None},
               "pyramid": {"pyramid": None}}[next(iter(options))]
    base = {"pooling": None} if "pool_query_heads" in options else {}
    _same_cache(_compress(llama, ids, methods.StructKV(kv_budget=0.2, pivot=2, **neutral)),
                _compress(llama, ids, methods.StructKV(kv_budget=0.2, pivot=2, **base)))
    with pytest.raises(ValueError, match="observe must be"):
        methods.SnapKV(observe=4)


def test_the_context_default_follows_the_kind_of_model():
    """A context compressed before its questions gets its kind's default (research/results/README.md,
    "Third choice"): models with sliding-window layers the union at 10 %, dense models KeyDiff at
    10 %; the kind is read from `layer_types`, and each default builds at its budget."""
    from structkv.models.config import ModelConfig, RopeConfig

    base = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=112, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                rope={"full_attention": RopeConfig(1e4), "sliding_attention": RopeConfig(1e4)})
    dense = ModelConfig(**base, layer_types=("full_attention",) * 4)
    hybrid = ModelConfig(**base, sliding_window=8,
                         layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"))
    assert methods.model_kind(dense) == "dense" and methods.model_kind(hybrid) == "sliding"
    assert methods.context_default(dense) == ("keydiff", 0.1)
    assert methods.context_default(hybrid) == ("structkv_agnostic_union", 0.1)
    for config in (dense, hybrid):
        name, kv = methods.context_default(config)
        method = methods.build(name, kv=kv)
        assert method.kv_budget == kv and methods.context_archive(method) == "int4"
