"""One prefill for many methods, one stacked decode for many states: equal to running each alone."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.models.kv_cache import StackedKVCache
from structkv.runtime.compress import compress, compress_shared
from structkv.runtime.generation import generate_states
from structkv.text.prompts import encode_batch


def _ids(n, seed=0):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tiny_dir):
    return {arch: structkv.load(tiny_dir(arch)) for arch in ("llama", "gemma3_text")}


def _groups():
    """Method groups with one prefill key each (one lane)."""
    return [
        [methods.get("full"), methods.get("streaming_llm", kv_budget=0.3), methods.get("snapkv", kv_budget=0.2),
         methods.get("pyramidkv", kv_budget=0.2), methods.get("h2o", kv_budget=0.2),
         methods.get("snapkv", kv_budget=0.4)],
        [methods.get("structkv", kv_budget=0.2), methods.get("structkv", kv_budget=0.4)],
        [methods.get("structkv", kv_budget=0.2, pivot=1), methods.get("structkv", kv_budget=0.5, pivot=1)],
        [methods.get("structkv", kv_budget=0.2, beta=3.0, skeleton="union", equal_compute=True),
         methods.get("structkv", kv_budget=0.4, beta=1.0, skeleton="union", equal_compute=True)],
        [methods.get("fastkv", kv_budget=0.2, tsp_layer=1), methods.get("fastkv", kv_budget=0.4, tsp_layer=1)],
        [methods.get("gemfilter", kv_budget=0.2)],
    ]


def _same_state(shared, alone):
    assert shared.stats["method"] == alone.stats["method"]
    assert shared.stats["tokens_per_layer"] == alone.stats["tokens_per_layer"]
    assert shared.stats["kv_bytes_per_layer"] == alone.stats["kv_bytes_per_layer"]
    for key in ("pivot_layer", "prefill_fraction", "host_syncs", "centrality_layers"):
        assert shared.stats.get(key) == alone.stats.get(key), key
    if shared.kept_columns is not None or alone.kept_columns is not None:
        assert torch.equal(shared.kept_columns, alone.kept_columns)
    torch.testing.assert_close(shared.logits, alone.logits, rtol=0, atol=1e-5)
    assert torch.equal(shared.next_positions, alone.next_positions)
    for a, b in zip(shared.cache.layers, alone.cache.layers):
        assert torch.equal(a.pos, b.pos)
        torch.testing.assert_close(a.k, b.k, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.v, b.v, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_shared_prefill_equals_each_method_alone(arch, models):
    model = models[arch]
    tokens, positions, _ = encode_batch(model, [_ids(70, 1), _ids(55, 2)])  # a padded batch
    for group in _groups():
        states = compress_shared(model, tokens, positions, group, room=16)
        assert len(states) == len(group)
        for method, state in zip(group, states):
            assert state.method is method
            _same_state(state, compress(model, tokens, positions, method, room=16))
            assert state.stats["prefill_s"] <= state.stats.get("shared_prefill", {}).get("pass_s", 1e9)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_one_prefill_for_every_method_equals_each_alone(arch, models):
    """All lanes in one pass: they share the layers before each one's propagation, then fork."""
    model = models[arch]
    tokens, positions, _ = encode_batch(model, [_ids(70, 1), _ids(55, 2)])
    group = [m for g in _groups() for m in g]
    states = compress_shared(model, tokens, positions, group, room=16)
    for method, state in zip(group, states):
        assert state.method is method
        _same_state(state, compress(model, tokens, positions, method, room=16))
        shared = state.stats["shared_prefill"]
        assert shared["methods"] == len(group) and shared["lanes"] == len(_groups())
        assert 0 < state.stats["prefill_s"] <= shared["pass_s"]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_stacked_decode_equals_each_generation_alone(arch, models):
    model = models[arch]
    ids = _ids(64, 3)
    tokens, positions, _ = encode_batch(model, [ids])
    states, alone = [], []
    for group in _groups():
        states += compress_shared(model, tokens, positions, group, room=12)
        for method in group:
            alone.append(structkv.generate(model, ids, max_new_tokens=12, stop_at_eos=False, compile=False,
                                           method=method))
    results = generate_states(model, states, max_new_tokens=12, stop_at_eos=False, compile=False)
    for state, mine, ref in zip(states, results, alone):
        assert mine.token_ids == ref.token_ids, state.method.name
        assert mine.stats["method"] == ref.stats["method"]
        assert mine.stats["decode_rows"] == len(states)
        assert mine.stats["kv_cache_bytes"] == ref.stats["kv_cache_bytes"]
    # the states were copied, not consumed: decoding again gives the same tokens
    again = generate_states(model, states[:2], max_new_tokens=12, stop_at_eos=False, compile=False)
    assert [r.token_ids for r in again] == [r.token_ids for r in results[:2]]


def test_stacking_a_short_sliding_layer_into_rings(models):
    """GemFilter's re-run on few tokens leaves Gemma's sliding layers as plain buffers (prompt + room
    fit the window); stacked with ring layers they are converted to rings, and decode is unchanged."""
    model = models["gemma3_text"]
    ids = _ids(60, 4)
    tokens, positions, _ = encode_batch(model, [ids])
    gem = compress(model, tokens, positions, methods.get("gemfilter", kv_budget=0.1), room=2)  # 6 tokens + 2 <= 8
    full = compress(model, tokens, positions, methods.get("full"), room=2)
    assert gem.cache.layers[0].sliding_window is None and full.cache.layers[0].sliding_window == 8
    stacked = StackedKVCache([gem.cache, full.cache])
    assert stacked.layers[0].sliding_window == 8 and stacked.rows == [1, 1]
    out = generate_states(model, [gem, full], max_new_tokens=2, stop_at_eos=False, compile=False)
    for state, result in zip((gem, full), out):
        ref = structkv.generate(model, ids, max_new_tokens=2, stop_at_eos=False, compile=False, method=state.method)
        assert result.token_ids == ref.token_ids


@settings(max_examples=8, deadline=None)
@given(budgets=st.lists(st.sampled_from([0.15, 0.25, 0.5, 1.0]), min_size=1, max_size=4),
       names=st.lists(st.sampled_from(["full", "streaming_llm", "snapkv", "pyramidkv", "h2o", "fastkv", "structkv",
                                       "gemfilter"]), min_size=1, max_size=4),
       n=st.integers(60, 90), seed=st.integers(0, 1000))
def test_any_mix_of_methods_shares_exactly(budgets, names, n, seed, models):
    """Property: whatever the mix of methods and budgets, each shared state is its own `compress`
    (same kept entries, propagated tokens, pivots and logits)."""
    model = models["llama"]
    tokens, positions, _ = encode_batch(model, [_ids(n, seed)])
    group = [methods.get(name) if name == "full" else methods.get(name, kv_budget=b) for name, b in zip(names, budgets)]
    for method, state in zip(group, compress_shared(model, tokens, positions, group, room=8)):
        _same_state(state, compress(model, tokens, positions, method, room=8))


def test_bad_input(models):
    model = models["llama"]
    tokens, positions, _ = encode_batch(model, [_ids(60)])
    with pytest.raises(ValueError, match="outside the model's layers"):  # the plan checks every method
        compress_shared(model, tokens, positions, [methods.get("full"), methods.get("fastkv", tsp_layer=7)])
    with pytest.raises(ValueError, match="at least one method"):
        compress_shared(model, tokens, positions, [])
    state = compress(model, tokens, positions, methods.get("snapkv", kv_budget=0.2), room=4)
    with pytest.raises(ValueError, match="free cache slots"):
        generate_states(model, [state], max_new_tokens=100, compile=False)
    with pytest.raises(ValueError, match="at least one state"):
        generate_states(model, [], compile=False)
