"""Query-agnostic methods (compress once, ask many): KVzip's reconstruction scores against a plain
full-forward reference, KeyDiff's scores against their definition, and their invariants."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.methods.kvzip import reconstruction_scores
from structkv.runtime.compress import compress, compress_shared
from structkv.text.prompts import encode_batch


def _ids(n, seed=0):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def model(request, tiny_dir):
    return structkv.load(tiny_dir(request.param))


def _reference(model, ids, prompt, chunk):
    """Per full-attention layer, the max attention each context token gets from the chunk queries
    of a plain causal forward over context + prompt + chunk (no cache), max over the KV group."""
    n, cfg = len(ids), model.config
    out = {i: torch.zeros(1, cfg.num_kv_heads, n) for i in cfg.full_attention_layers}
    for s in range(0, n, chunk):
        seq = torch.tensor([ids + prompt + ids[s:s + chunk]])
        S = seq.shape[1] - n
        qk = {}
        model(seq, on_layer=lambda i, h, p, q, k, v: qk.__setitem__(i, (q, k)))
        for i in out:
            q, k = qk[i]
            G = q.shape[1] // k.shape[1]
            logits = torch.einsum("bhsd,bhtd->bhst", q.float(), k.repeat_interleave(G, 1).float()) * cfg.scale
            causal = torch.ones(seq.shape[1], seq.shape[1], dtype=torch.bool).tril()
            probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)[:, :, n:, :n]  # (1, Hq, S, n)
            per_kv = probs.reshape(1, k.shape[1], G, S, n).amax(dim=(2, 3))
            out[i] = torch.maximum(out[i], per_kv)
    return out


@pytest.mark.parametrize("chunk", [7, 64])
def test_reconstruction_scores_equal_a_plain_forward(model, chunk):
    ids, prompt = _ids(40, 3), [5, 9, 11]
    tokens, positions, _ = encode_batch(model, [ids])
    full = compress(model, tokens, positions, methods.get("full"), room=0)
    # the held context of every full-attention layer, the others as the full cache holds them
    held, cache = {}, full.cache
    _, kv = model.prompt_pass(tokens, positions)
    for i in model.config.full_attention_layers:
        held[i] = (kv[i][0], kv[i][1], positions)
    from structkv.methods.kvzip import _row
    rings = {i: _row(layer, 0, len(prompt) + chunk) for i, layer in enumerate(cache.layers) if i not in held}
    scores, run, _ = reconstruction_scores(model, held, rings, tokens[0], prompt, chunk)
    assert run == len(ids) + math.ceil(len(ids) / chunk) * len(prompt)
    ref = _reference(model, ids, prompt, chunk)
    for i in ref:
        torch.testing.assert_close(scores[i], ref[i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["kvzip", "keydiff"])
def test_budget_is_met_exactly_and_the_window_is_kept(model, name):
    ids = _ids(90, 1)
    tokens, positions, _ = encode_batch(model, [ids])
    method = methods.get(name, kv_budget=20, window=6, **({"chunk": 32} if name == "kvzip" else {}))
    state = compress(model, tokens, positions, method, room=8)
    for i in model.config.full_attention_layers:
        pos = state.cache.layers[i].pos[0]  # (Hkv, C)
        for head in pos:
            kept = head[head >= 0]
            assert len(kept) == 20 and len(set(kept.tolist())) == 20  # exact budget, unique
            assert set(range(84, 90)) <= set(kept.tolist())  # the window
            assert torch.equal(kept, kept.sort().values)  # original positions, in order


def test_kvzip_reports_its_extra_prefill(model):
    ids = _ids(70, 2)
    tokens, positions, _ = encode_batch(model, [ids])
    state = compress(model, tokens, positions, methods.get("kvzip", kv_budget=0.2, chunk=32, prompt=""), room=8)
    assert state.stats.reconstruction_tokens == 70  # no prompt ids: the context once more
    assert state.stats.prefill_fraction == pytest.approx(2.0)
    assert 0 <= state.stats.reconstruction_s <= state.stats.prefill_s


def test_kvzip_in_a_padded_batch_equals_each_row_alone(model):
    a, b = _ids(70, 4), _ids(52, 5)
    tokens, positions, _ = encode_batch(model, [a, b])
    method = methods.get("kvzip", kv_budget=0.25, chunk=24)
    batch = compress(model, tokens, positions, method, room=8)
    for row, ids in enumerate((a, b)):
        t, p, _ = encode_batch(model, [ids])
        alone = compress(model, t, p, method, room=8)
        for x, y in zip(batch.cache.layers, alone.cache.layers):
            kept_x = x.pos[row][x.pos[row] >= 0]
            kept_y = y.pos[0][y.pos[0] >= 0]
            assert torch.equal(kept_x.sort().values, kept_y.sort().values)
        torch.testing.assert_close(batch.logits[row], alone.logits[0], rtol=0, atol=1e-4)


def test_keydiff_scores_are_minus_cosine_to_the_mean_key(model):
    ids = _ids(50, 6)
    tokens, positions, _ = encode_batch(model, [ids])
    seen = {}

    def observe(view):
        if view.layer in model.config.full_attention_layers:
            seen[view.layer] = (methods.get("keydiff").kv_scores(view), view.k)
    compress_shared(model, tokens, positions, [methods.get("full")], room=0, observe=observe)
    for scores, k in seen.values():
        keys = torch.nn.functional.normalize(k.float(), dim=-1)  # (1, Hkv, n, D)
        anchor = keys.mean(2, keepdim=True)
        want = -(keys * anchor).sum(-1) / anchor.norm(dim=-1)
        torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-6)


def test_query_agnostic_methods_share_the_full_prefill(model):
    """Their hidden states are the full cache's: one lane with SnapKV, each state its own compress."""
    tokens, positions, _ = encode_batch(model, [_ids(64, 7)])
    group = [methods.get("snapkv", kv_budget=0.2), methods.get("kvzip", kv_budget=0.2, chunk=16),
             methods.get("keydiff", kv_budget=0.3)]
    states = compress_shared(model, tokens, positions, group, room=8)
    assert states[0].stats.shared_prefill["lanes"] == 1
    for method, state in zip(group, states):
        alone = compress(model, tokens, positions, method, room=8)
        for x, y in zip(state.cache.layers, alone.cache.layers):
            assert torch.equal(x.pos, y.pos)
        assert state.stats.reconstruction_tokens == alone.stats.reconstruction_tokens


def test_kvzip_budgets_of_one_lane_reconstruct_once(model, monkeypatch):
    """Two KVzip budgets see the same context and K/V: one reconstruction serves both, each
    state equal to its method alone and charged the reconstruction in full."""
    import structkv.methods.kvzip as rec

    calls, real = [], rec.reconstruction_scores
    monkeypatch.setattr(rec, "reconstruction_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens, positions, _ = encode_batch(model, [_ids(64, 9)])
    group = [methods.get("kvzip", kv_budget=0.2, chunk=16), methods.get("kvzip", kv_budget=0.4, chunk=16)]
    states = compress_shared(model, tokens, positions, group, room=8)
    assert len(calls) == 1
    for method, state in zip(group, states):
        alone = compress(model, tokens, positions, method, room=8)
        assert all(torch.equal(x.pos, y.pos) for x, y in zip(state.cache.layers, alone.cache.layers))
        assert state.stats.reconstruction_tokens == alone.stats.reconstruction_tokens > 0


@pytest.mark.parametrize("options, message", [({"chunk": 0}, "chunk must be a positive int"),
                                              ({"prompt": 3}, "prompt must be text"),
                                              ({"window": -1}, "window must be an int")])
def test_bad_kvzip_options(options, message):
    with pytest.raises(ValueError, match=message):
        methods.get("kvzip", **options)


def _rotation(inv_freq, position):
    """The RoPE rotation of `position` as a (D, D) matrix (HF rotate_half layout)."""
    half = inv_freq.shape[0]
    angles = position * inv_freq
    R = torch.zeros(2 * half, 2 * half)
    for j, a in enumerate(angles.tolist()):
        c, s = math.cos(a), math.sin(a)
        R[j, j], R[j, j + half], R[j + half, j], R[j + half, j + half] = c, -s, s, c
    return R


@pytest.mark.parametrize("covariance, vnorm", [(True, True), (False, False)])
def test_expected_attention_equals_its_formula_with_rotation_matrices(model, covariance, vnorm):
    ids = _ids(30, 8)
    tokens, positions, _ = encode_batch(model, [ids])
    method = methods.get("expected_attention", future=5, sinks=2, covariance=covariance, vnorm=vnorm)
    seen = {}

    def observe(view):
        if view.layer == model.config.full_attention_layers[0]:
            seen["x"] = (method.kv_scores(view), view.q, view.k, view.v, view.inv_freq)
    compress_shared(model, tokens, positions, [methods.get("full")], room=0, observe=observe)
    scores, q, k, v, inv_freq = seen["x"]
    n, G, scale = len(ids), q.shape[1] // k.shape[1], model.config.scale
    pre = torch.stack([_rotation(inv_freq, p).T @ q[0, :, p].T.float() for p in range(n)], 1).permute(2, 1, 0)
    mean_R = sum(_rotation(inv_freq, n + t) for t in range(5)) / 5
    want = torch.zeros(k.shape[1], n)
    for h in range(q.shape[1]):
        x = pre[h, 2:]  # (n - sinks, D): the statistics leave out the sinks
        mu = mean_R @ x.mean(0)
        keys = k[0, h // G].float()
        logits = scale * keys @ mu
        if covariance:
            sigma = mean_R @ ((x - x.mean(0)).T @ (x - x.mean(0)) / x.shape[0]) @ mean_R.T
            logits = logits + 0.5 * scale**2 * ((keys @ sigma) * keys).sum(-1)
        p = logits.softmax(-1) * (v[0, h // G].float().norm(dim=-1) if vnorm else 1)
        want[h // G] += p
    torch.testing.assert_close(scores[0], want, rtol=1e-4, atol=1e-6)


def test_structkv_novelty_keeps_the_top_pooled_novel_keys_and_its_prefill_saving(model):
    """signal="novelty": the skeleton at the fixed pivot is the top of the pivot layer's pooled key
    novelty (plus the window) and each later layer keeps its own top pooled novelty (beta 0);
    the prefill still computes fewer token-layers."""
    from structkv.modules import pooled_saliency
    from structkv.modules.scores import key_novelty

    ids = _ids(120, 4)
    tokens, positions, _ = encode_batch(model, [ids])
    method = methods.get("structkv", signal="novelty", beta=0.0, kv_budget=30, struct_budget=48, pivot=0.5)
    state = compress(model, tokens, positions, method, room=8)
    assert state.stats.prefill_fraction < 1.0
    pivot = state.stats.pivot_layer
    seen = {}
    compress_shared(model, tokens, positions, [methods.get("full")], room=0,
                    observe=lambda v: seen.setdefault(v.layer, v.k) if v.layer == pivot else None)
    n = len(ids)
    score = pooled_saliency(key_novelty(seen[pivot], torch.ones(1, n, dtype=torch.bool)), 8, 7, "max").sum(1)[0]
    best = set(torch.sort(score[: n - 8], descending=True, stable=True).indices[:40].tolist())
    assert set(state.kept_columns[0].tolist()) == best | set(range(n - 8, n))
    for i in model.config.full_attention_layers:
        if i > pivot:
            assert all(int((h >= 0).sum()) == 30 for h in state.cache.layers[i].pos[0])  # exact budget


@pytest.mark.parametrize("signal,window_share", [("mixed", 0.5), ("union", 0.5), ("union", 0.25)])
def test_structkv_blended_signals_keep_the_top_of_both(model, signal, window_share):
    """signal="mixed": the skeleton is the top of the pooled sum of the window's attention and the
    keys' novelty, each as its share of the columns before the window; "union": of the larger of
    their percentile ranks there, each rank's distance from the top stretched by 0.5 / its share
    (plus the window, always)."""
    from structkv.modules import pooled_saliency
    from structkv.modules.scores import key_novelty
    from structkv.ops import window_scores

    ids, w = _ids(120, 5), 8
    tokens, positions, _ = encode_batch(model, [ids])
    method = methods.get("structkv", signal=signal, beta=0.0, kv_budget=30, struct_budget=48, pivot=0.5,
                         window_share=window_share)
    state = compress(model, tokens, positions, method, room=8)
    pivot, n = state.stats.pivot_layer, len(ids)
    seen = {}
    compress_shared(model, tokens, positions, [methods.get("full")], room=0, observe=lambda v: seen.setdefault(
        v.layer, (v.q, v.k, v.positions, v.scale)) if v.layer == pivot else None)
    q, k, pos, scale = seen[pivot]
    ranked = (torch.arange(n) < n - w).float()

    def share(x):
        return x * ranked / (x * ranked).sum(-1, keepdim=True)

    def percentile(x):  # rank among the first n - w columns, 1 = the largest
        head = x[..., : n - w]
        ranks = (head[..., None, :] <= head[..., :, None]).sum(-1).float() / (n - w)  # (B, H, n - w); no ties
        return torch.cat([ranks, torch.zeros_like(x[..., n - w:])], -1)

    attention = window_scores(q[:, :, n - w:], k, pos[:, n - w:].contiguous(), pos, scale=scale)  # (1, Hkv, n)
    novelty = key_novelty(k, torch.ones(1, n, dtype=torch.bool))
    def stretched(x, part):  # distance from the top, 1 - x, times 0.5 / part; off the ranked columns 0
        return (1 - (1 - percentile(x)) * 0.5 / part).clamp_min(0) * ranked

    blend = (share(attention) + share(novelty) if signal == "mixed"
             else torch.maximum(stretched(attention, window_share), stretched(novelty, 1 - window_share)))
    score = pooled_saliency(blend, w, 7, "max").sum(1)[0]
    best = set(torch.sort(score[: n - w], descending=True, stable=True).indices[:40].tolist())
    assert set(state.kept_columns[0].tolist()) == best | set(range(n - w, n))
    for i in model.config.full_attention_layers:
        if i > pivot:
            assert all(int((h >= 0).sum()) == 30 for h in state.cache.layers[i].pos[0])  # exact budget


@settings(max_examples=60, deadline=None)
@given(n=st.integers(20, 400), frac=st.floats(0.02, 0.5), share=st.floats(0.05, 0.95), seed=st.integers(0, 99))
def test_percentile_union_splits_the_budget_by_share(n, frac, share, seed):
    """Two signals ranking the columns in opposite orders (no column high in both; K <= n / 2): the top K of
    their union holds share * K of the first signal's top columns and the rest of the second's,
    to within a column either way."""
    from structkv.modules.scores import percentile_of, percentile_union

    x = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).float()[None, None]  # (1, 1, n)
    ranked = torch.ones(1, n, dtype=torch.bool)
    a, b = percentile_of(x, ranked), percentile_of(-x, ranked)
    K = max(1, int(frac * n))
    top = set(percentile_union(a, b, share)[0, 0].topk(K).indices.tolist())
    from_a = len(top & set(x[0, 0].topk(K).indices.tolist()))
    assert abs(from_a - share * K) <= 1


def test_kv_signal_ranks_the_entries_while_the_skeleton_keeps_its_signal(model):
    """kv_signal="novelty" under signal="union": the skeleton is the union's (the same columns go on
    past the pivot), each layer up to the pivot (all tokens there) keeps what novelty alone keeps
    there (beta 0)."""
    ids = _ids(120, 6)
    tokens, positions, _ = encode_batch(model, [ids])
    common = dict(beta=0.0, kv_budget=30, struct_budget=48, pivot=0.5, window=8)
    split, union, novelty = (compress(model, tokens, positions, methods.get("structkv", **o, **common), room=8)
                             for o in (dict(signal="union", kv_signal="novelty"), dict(signal="union"),
                                       dict(signal="novelty")))
    assert split.kept_columns[0].tolist() == union.kept_columns[0].tolist()
    pivot = split.stats.pivot_layer
    before = [i for i in model.config.full_attention_layers if i <= pivot]
    assert before
    for i in before:
        torch.testing.assert_close(split.cache.layers[i].pos, novelty.cache.layers[i].pos)
    assert any(not torch.equal(union.cache.layers[i].pos, novelty.cache.layers[i].pos) for i in before)
    with pytest.raises(ValueError, match="kv_signal must be None"):
        methods.get("structkv", signal="union", kv_signal="question")


def test_window_share_is_a_fraction():
    for bad in (0, 1, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="window_share must be a fraction in \\(0, 1\\)"):
            methods.get("structkv", signal="union", window_share=bad)


def test_novelty_needs_a_fixed_pivot():
    for signal in ("novelty", "mixed", "union"):
        with pytest.raises(ValueError, match=f"signal '{signal}' needs a fixed pivot"):
            methods.get("structkv", signal=signal, pivot="dynamic")
    with pytest.raises(ValueError, match="signal must be 'window', 'novelty', 'mixed' or 'union'"):
        methods.get("structkv", signal="query")


def test_local_reconstruction_scores_softmax_over_the_chunks_own_span(model):
    """kvpress's scoring (`local`): each chunk's softmax runs over the first 4 tokens, the chunk's own
    span of the context and the repeat itself; entries outside the span get nothing from it."""
    from structkv.methods.kvzip import LOCAL_SINKS

    ids, prompt, chunk = _ids(40, 3), [5, 9, 11], 16
    tokens, positions, _ = encode_batch(model, [ids])
    _, kv = model.prompt_pass(tokens, positions)
    full = compress(model, tokens, positions, methods.get("full"), room=0)
    held = {i: (kv[i][0], kv[i][1], positions) for i in model.config.full_attention_layers}
    from structkv.methods.kvzip import _row
    rings = {i: _row(layer, 0, len(prompt) + chunk) for i, layer in enumerate(full.cache.layers) if i not in held}
    scores, _, _ = reconstruction_scores(model, held, rings, tokens[0], prompt, chunk, local=True)
    n, cfg = len(ids), model.config
    for i in held:
        ref = torch.zeros(1, cfg.num_kv_heads, n)
        for s in range(0, n, chunk):
            seq = torch.tensor([ids + prompt + ids[s:s + chunk]])
            qk = {}
            model(seq, on_layer=lambda j, h, p, q, k, v: qk.__setitem__(j, (q, k)))
            q, k = qk[i]
            G = q.shape[1] // k.shape[1]
            logits = torch.einsum("bhsd,bhtd->bhst", q.float(), k.repeat_interleave(G, 1).float()) * cfg.scale
            T = seq.shape[1]
            keep = torch.zeros(T, dtype=torch.bool)
            keep[:LOCAL_SINKS], keep[s:min(s + chunk, n)], keep[n:] = True, True, True
            mask = torch.ones(T, T, dtype=torch.bool).tril() & keep
            probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)[:, :, n:, :n]
            ref = torch.maximum(ref, probs.reshape(1, k.shape[1], G, -1, n).amax(dim=(2, 3)))
        torch.testing.assert_close(scores[i], ref, rtol=1e-4, atol=1e-5)


def test_kvzip_kvpress_keeps_its_sinks_and_asks_as_the_assistant(tiny_dir):
    from structkv.methods.kvzip import _reconstruction_prompt
    from structkv.text import chat

    model = structkv.load(tiny_dir("llama"))
    method = methods.get("kvzip_kvpress", kv_budget=12, chunk=32)
    state = compress(model, *encode_batch(model, [_ids(90, 2)])[:2], method, room=4)
    for i in model.config.full_attention_layers:
        for head in state.cache.layers[i].pos[0]:
            assert {0, 1, 2, 3} <= set(head[head >= 0].tolist())
    class Templated:
        chat_template = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>"
        bos_id, eos_ids = None, []

        def encode(self, text, add_bos=False):
            return [ord(c) for c in text]

    prompt, head = _reconstruction_prompt(Templated(), method)
    h, t = chat.frame(Templated())
    assert head == h and prompt(0, []) == Templated().encode(method.prompt) + t
    assert prompt(1, list(range(20)))[-len(t) - 8:-len(t)] == list(range(12, 20))  # "starting with" the last 8


def test_kvzip_global_budget_keeps_the_same_total_by_one_threshold(model):
    """budget="global": the layers' and heads' shares differ, the total kept is the per-layer plan's,
    window and sinks kept."""
    ids = _ids(100, 4)
    tokens, positions, _ = encode_batch(model, [ids])
    layered = compress(model, tokens, positions, methods.get("kvzip", kv_budget=15, chunk=32, sinks=2), room=8)
    pooled = compress(model, tokens, positions, methods.get("kvzip", kv_budget=15, chunk=32, sinks=2,
                                                             budget="global"), room=8)
    layers = model.config.full_attention_layers
    assert sum(pooled.cache.entries()[i] for i in layers) == sum(layered.cache.entries()[i] for i in layers)
    counts = {(i, h): int((pooled.cache.layers[i].pos[0, h] >= 0).sum()) for i in layers for h in range(2)}
    assert len(set(counts.values())) > 1  # shares follow the scores
    for i in layers:
        for head in pooled.cache.layers[i].pos[0]:
            kept = set(head[head >= 0].tolist())
            assert {0, 1} | set(range(92, 100)) <= kept  # sinks and the window
    assert pooled.cache.free() >= 8  # every layer keeps its room
