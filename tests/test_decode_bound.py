"""A KV bound while generating (`max_kv_tokens`): the bound holds at every step, a bound the
generation never reaches changes nothing, sinks and the recent window always stay, batched rows
equal alone, and it stacks with every prefill method, quantized entries, states and compile."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.modules import DecodeBound
from structkv.runtime.decoding import Decoding, bounded
from structkv.runtime.generation import start


def _ids(n, seed=0):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tiny_dir):
    return {arch: structkv.load(tiny_dir(arch)) for arch in ("llama", "gemma3_text")}


def _entries(cache) -> list[int]:
    """The most entries any (row, KV head) holds, per layer."""
    return [int((layer.pos >= 0).sum(-1).max()) for layer in cache.layers]


def _run(model, prompt, new, bound, method=None):
    """Feed greedy tokens through a bounded decode; yields the cache after every step."""
    with torch.inference_mode():
        run = start(model, prompt, max_new_tokens=new, method=method, bound=bound)
        rows = Decoding(model, run.cache, run.logits, run.next_pos, bound=bounded(model, run.cache, bound))
        for _ in range(new):
            rows.feed(rows.logits.argmax(-1))
            yield rows


METHODS = [None, "snapkv", "structkv", "streaming_llm"]
RULES = ["window", "redundancy", "recent", "centrality"]


@given(bound=st.integers(16, 40), length=st.integers(5, 50), new=st.integers(1, 60),
       rule=st.sampled_from(RULES), method=st.sampled_from(METHODS),
       arch=st.sampled_from(["llama", "gemma3_text"]))
def test_bound_holds_at_every_step(models, bound, length, new, rule, method, arch):
    model = models[arch]
    b = DecodeBound(bound, rule)
    for rows in _run(model, _ids(length), new, b, methods.get(method) if method else None):
        assert max(_entries(rows.cache)) <= bound
    assert max(rows.bound.stats()["kv_entries_max"]) <= bound


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("rule", ["recent", "centrality"])
def test_bound_never_reached_is_no_bound(models, arch, rule):
    """(The centrality rule's full prefill is StructKV keeping everything: the full cache exactly.)"""
    model = models[arch]
    free = structkv.generate(model, _ids(30), max_new_tokens=40, stop_at_eos=False, compile=False)
    big = structkv.generate(model, _ids(30), max_new_tokens=40, stop_at_eos=False, compile=False,
                            max_kv_tokens=DecodeBound(70, rule))
    assert big.token_ids == free.token_ids
    assert big.stats["kv_evictions"] == 0 and big.stats["method"] == "full"


@pytest.mark.parametrize("rule", RULES)
def test_sinks_and_recent_window_always_stay(models, rule):
    model = models["llama"]
    b = DecodeBound(24, rule, sinks=3, recent=6, every=4)
    length = 30
    for step, rows in enumerate(_run(model, _ids(length), 40, b)):
        newest = length + step  # the position just written
        for layer in rows.cache.layers:
            for head in layer.pos[0]:
                kept = set(head[head >= 0].tolist())
                assert {0, 1, 2} <= kept
                assert set(range(newest - 5, newest + 1)) <= kept


@pytest.mark.parametrize("method, rule", [(None, "redundancy"), ("snapkv", "redundancy"), ("structkv", "centrality"),
                                          (None, "centrality")])
def test_batched_rows_equal_alone(models, method, rule):
    model = models["gemma3_text"]
    prompts = [_ids(20, 1), _ids(45, 2), _ids(33, 3)]
    m = methods.get(method) if method else None
    kw = dict(max_new_tokens=80, stop_at_eos=False, compile=False, max_kv_tokens=DecodeBound(28, rule))
    together = structkv.generate(model, prompts, method=m, **kw).token_ids
    alone = [structkv.generate(model, p, method=m, **kw).token_ids for p in prompts]
    assert together == alone


def test_structkv_prefill_seeds_the_centrality_rule(models):
    """A StructKV prefill leaves its centrality (one layer's scale) in every layer's table; a prompt
    longer than the bound then evicts by it before the first query: the kept entries are the
    sinks, the recent window and the positions with the highest prefill centrality."""
    model = models["llama"]
    method = methods.get("structkv", kv_budget=1.0, struct_budget=1.0)
    state = structkv.prefill(model, _ids(60), method, room=8)
    table = state.cache.layers[0].carried[0, :60]
    assert all(torch.equal(layer.carried[0, :60], table) for layer in state.cache.layers)
    assert bool((table[:52] > 0).all())  # the observation window's 8 columns are never ranked: 0
    b = DecodeBound(30, "centrality", sinks=2, recent=4, every=6)
    run = next(_run(model, _ids(60), 1, b, method))
    ranked = [p for p in table.argsort(descending=True).tolist() if 2 <= p < 56][:b.low - 2 - 4]
    for layer in run.cache.layers:
        kept = set(layer.pos[0, 0][layer.pos[0, 0] >= 0].tolist())
        assert set(ranked) | {0, 1, 56, 57, 58, 59} <= kept


def test_fold_matches_a_plain_loop():
    """The carried centrality after a fold: decayed old table plus, per position, the attention each
    new query gave it (softmax over the entries it could see), averaged over the new queries and
    summed over all query heads."""
    from structkv.models.kv_cache import LayerKVCache
    from structkv.modules import decode_bound as db

    torch.manual_seed(0)
    B, Hkv, C, D, G, n = 2, 2, 12, 8, 2, 5
    layer = LayerKVCache(B, Hkv, C, D, torch.float32, "cpu")
    layer.write(torch.randn(B, Hkv, C, D), torch.randn(B, Hkv, C, D), torch.arange(C).repeat(B, 1))
    layer.pos[1, 0, 3] = -1  # an evicted slot
    layer.keep_queries(n, Hkv * G)
    layer.q_recent.normal_()
    layer.q_pos.copy_(torch.tensor([[7, 8, 9, 10, 11], [9, 10, 11, -1, -1]]))
    layer.carry_centrality(C)
    old = torch.rand(B, C)
    layer.carried.copy_(old)
    layer.carried_upto.copy_(torch.tensor([8, -1]))
    db.fold(layer, [0, 1])
    k = layer.k.float()
    for b, new in ((0, [2, 3, 4]), (1, [0, 1, 2])):
        want = old[b] * db.CARRY_DECAY ** (len(new) / db.QUERY_WINDOW)
        for s in new:
            qp = int(layer.q_pos[b, s])
            for h in range(Hkv * G):
                kv = h // G
                seen = (layer.pos[b, kv] >= 0) & (layer.pos[b, kv] <= qp)
                logits = (k[b, kv] @ layer.q_recent[b, h, s]).masked_fill(~seen, float("-inf"))
                p = logits.softmax(-1)
                for c in range(C):
                    if seen[c]:
                        want[int(layer.pos[b, kv, c])] += p[c] / len(new)
        torch.testing.assert_close(layer.carried[b], want)
    assert layer.carried_upto.tolist() == [11, 11]


def test_compiled_equals_eager(models):
    model = models["llama"]
    kw = dict(max_new_tokens=60, stop_at_eos=False, max_kv_tokens=32)
    assert structkv.generate(model, _ids(40), compile=True, **kw).token_ids == \
        structkv.generate(model, _ids(40), compile=False, **kw).token_ids


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_entries(tiny_dir, kv_dtype):
    model = structkv.load(tiny_dir("llama"), kv_dtype=kv_dtype)
    out = structkv.generate(model, _ids(40), max_new_tokens=50, stop_at_eos=False, compile=False, max_kv_tokens=32)
    assert len(out.token_ids) == 50 and max(out.stats["kv_entries_max"]) <= 32


def test_state_generates_past_its_room(models):
    """A state's room bounds new tokens without a bound; with one, the cache evicts instead."""
    model = models["llama"]
    state = structkv.prefill(model, _ids(60), methods.get("snapkv", kv_budget=0.5), room=8)
    with pytest.raises(ValueError, match="free cache"):
        structkv.generate(model, _ids(4, 9), state=state, max_new_tokens=40, compile=False)
    out = structkv.generate(model, _ids(4, 9), state=state, max_new_tokens=40, stop_at_eos=False, compile=False,
                            max_kv_tokens=40)
    assert len(out.token_ids) == 40 and max(out.stats["kv_entries_max"]) <= 40
    [stacked] = structkv.generate_states(model, [state], question=_ids(4, 9), max_new_tokens=40, stop_at_eos=False,
                                         compile=False, max_kv_tokens=40)
    assert stacked.token_ids == out.token_ids


def test_long_prompt_buffer_shrinks_to_the_bound(models):
    model = models["llama"]
    out = structkv.generate(model, _ids(200), max_new_tokens=10, stop_at_eos=False, compile=False, max_kv_tokens=64)
    full = structkv.generate(model, _ids(200), max_new_tokens=10, stop_at_eos=False, compile=False)
    assert out.stats["kv_cache_bytes"] * 2 <= full.stats["kv_cache_bytes"]  # 128 slots per layer, not 256


@pytest.mark.parametrize("bad", [0, -3, "512", True, 2.5])
def test_bad_bounds_are_refused(models, bad):
    with pytest.raises(ValueError, match="max_kv_tokens must be an int >= 1"):
        structkv.generate(models["llama"], _ids(10), max_new_tokens=4, compile=False, max_kv_tokens=bad)


def test_the_cli_offers_every_rule():
    from structkv.cli import DECODE_RULES
    from structkv.modules import decode_rules

    assert DECODE_RULES == tuple(decode_rules.RULES) == tuple(RULES)


def test_a_rule_of_your_own_is_one_registered_class(models, monkeypatch):
    """A new decode rule is a `DecodeRule` subclass registered by name: the bound then accepts
    the name, keeps queries or not as the rule asks, and ranks entries by its scores."""
    from structkv.modules import decode_rules

    calls = []

    class Oldest(decode_rules.DecodeRule):  # keeps the earliest positions: the opposite of "recent"
        name, needs_queries = "oldest", False

        def scores(self, layer, index, pos):
            calls.append(pos.shape)
            return -pos.float()

    monkeypatch.setitem(decode_rules.RULES, "oldest", Oldest())
    bound = DecodeBound(24, "oldest", sinks=0, recent=4)
    for rows in _run(models["llama"], _ids(30), 8, bound, None):
        for layer in rows.cache.layers:
            assert int((layer.pos >= 0).sum(-1).max()) <= 24
            assert not layer.query_slots  # no queries kept for it
    assert calls
    kept = set(rows.cache.layers[0].pos[0, 0][rows.cache.layers[0].pos[0, 0] >= 0].tolist())
    assert set(range(16)) <= kept  # the earliest positions stayed
    with pytest.raises(TypeError, match="named DecodeRule"):
        decode_rules.register(object())


def test_bad_rules_and_marks_are_refused():
    with pytest.raises(ValueError, match="unknown decode eviction rule 'attention'"):
        DecodeBound(64, "attention")
    with pytest.raises(ValueError, match="8 sinks \\+ 12 recent"):
        DecodeBound(20, sinks=8, recent=12)
    with pytest.raises(ValueError, match="every must be >= 1"):
        DecodeBound(64, every=0)
    with pytest.raises(ValueError, match="evicts the prompt itself"):
        DecodeBound(8)


def test_full_with_the_centrality_bound_is_full_and_says_so(models):
    """`full` under the centrality rule is the full cache with StructKV's centrality tracked
    (`Full(centrality=True)`): the typed prefill stats name `full` (they named `structkv`, relabelled
    only in the flat stats), and its first token is the plain full prefill's."""
    model, prompt = models["llama"], _ids(60)
    bounded = structkv.generate(model, prompt, max_new_tokens=1, compile=False, max_kv_tokens=40)
    plain = structkv.generate(model, prompt, max_new_tokens=1, compile=False)
    assert bounded.stats["method"] == "full" and bounded.prefill.method == "full"
    assert bounded.token_ids == plain.token_ids
    assert methods.get("full", centrality=True).prefill_key() != methods.get("full").prefill_key()
