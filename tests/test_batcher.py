"""Continuous batching (`structkv.serve.batcher`): requests that join and leave a running batch get
what `generate` gives each of them alone, whatever their methods, budgets, lengths and sampling."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.models.kv_cache import StackedKVCache
from structkv.runtime.generation import start
from structkv.serve.batcher import Batch, Row

# (prompt length, method, max new tokens, sampling); seeds make sampled rows repeatable
REQUESTS = [
    (40, "full", 9, {}),
    (120, "snapkv", 5, {}),
    (70, "structkv", 12, {}),
    (90, "full", 7, {"temperature": 1.0, "top_p": 0.9, "seed": 3}),
    (25, "streaming_llm", 10, {"temperature": 0.7, "seed": 11}),
]


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 90, (n,), generator=g).tolist()


def alone(model, ids, name, max_new, sampling):
    method = None if name == "full" else methods.build(name, kv=0.5, struct=0.5)
    out = structkv.generate(model, ids, method=method, max_new_tokens=max_new, compile=False, stop_at_eos=False,
                            **sampling)
    return out.token_ids


def row(model, ids, name, max_new, sampling):
    method = None if name == "full" else methods.build(name, kv=0.5, struct=0.5)
    return Row(start(model, ids, max_new_tokens=max_new, method=method), max_new, **sampling)


def requests(model) -> tuple[list[Row], list[list[int]]]:
    """REQUESTS' rows, prefilled, and each one's tokens from `generate` alone."""
    prompts = [prompt(n, i) for i, (n, *_) in enumerate(REQUESTS)]
    want = [alone(model, p, name, new, s) for p, (_, name, new, s) in zip(prompts, REQUESTS)]
    return [row(model, p, name, new, s) for p, (_, name, new, s) in zip(prompts, REQUESTS)], want


@pytest.mark.parametrize("arch,kv_dtype,weights", [("llama", None, "fp32"), ("gemma3_text", None, "fp32"),
                                                  ("llama", "int8", "fp32"), ("llama", None, "int8"),
                                                  ("llama", None, "int4")])
def test_rows_joining_and_leaving_get_their_lone_answers(tiny_dir, arch, kv_dtype, weights):
    """Five requests join at different steps (two at once, then one per step) and leave when their
    token limits differ; a hybrid model's sliding layers go through rings; int8 entries move with
    their scales; quantized weights' few-row products (each row's x rounded on its own) give every
    row its lone answer. Greedy and seeded sampled rows both equal `generate` alone."""
    model = structkv.load(tiny_dir(arch), kv_dtype=kv_dtype, weights=weights)
    rows, want = requests(model)
    batch = Batch(model)
    batch.eos = set()  # random weights: never stop early, so every row runs to its limit
    joins = {0: [0, 1], 2: [2], 3: [3], 5: [4]}  # step -> rows joining before it
    ended, step = [], 0
    while len(ended) < len(rows):
        for i in joins.get(step, ()):
            batch.join(rows[i])
        ended += batch.step()
        step += 1
    assert max(r.peers for r in rows) >= 4  # they really shared steps
    assert [r.tokens for r in rows] == want
    assert all(r.finish == "length" for r in rows) and len(batch) == 0 and batch.cache is None


def test_a_row_ends_on_eos_or_when_its_callback_says_so(tiny_dir):
    model = structkv.load(tiny_dir("llama"))
    ids = prompt(30, 0)
    first = alone(model, ids, "full", 6, {})
    batch = Batch(model)
    batch.eos = {first[2]}  # the third token is an end of sequence
    stopped, seen = Row(start(model, ids, max_new_tokens=6), 6), []
    told = Row(start(model, ids, max_new_tokens=6), 6, on_token=lambda t: seen.append(t) or len(seen) == 2)
    batch.join(stopped)
    batch.join(told)
    while len(batch):
        batch.step()
    assert stopped.tokens == first[:2] and stopped.finish == "stop"
    assert told.tokens == first[:2] and seen == first[:2] and told.finish == "stop"


def test_take_rows_and_stacking_with_room_keep_every_entry(tiny_dir):
    """Rows taken from a stacked cache hold exactly their entries; stacking with a room sizes the
    capacity for it; a model's sliding layers become rings when the room would pass the window."""
    model = structkv.load(tiny_dir("gemma3_text"))
    a, b = (start(model, prompt(n, n), max_new_tokens=4) for n in (6, 20))
    sliding_windows = [model.config.sliding_window_at(i) for i in range(model.config.num_layers)]
    stacked = StackedKVCache([a.cache, b.cache], room=50, sliding_windows=sliding_windows)
    for i, layer in enumerate(stacked.layers):
        if sliding_windows[i] is None:
            assert layer.capacity >= 20 + 50 and layer.sliding_window is None
        else:
            assert layer.sliding_window == sliding_windows[i]  # 20 + 50 would pass the window of 8
    back = stacked.take_rows([1])
    for layer, original in zip(back.layers, b.cache.layers):
        mine = sorted(p for p in layer.pos[0, 0].tolist() if p >= 0)
        assert mine == sorted(p for p in original.pos[0, 0].tolist() if p >= 0)


def test_slots_of_rows_that_left_are_given_back(tiny_dir):
    """A long prompt leaves a running batch: the next restack compacts the rows that stay, so the
    cache holds their entries, not the long row's slots (a busy server's batch never empties)."""
    model = structkv.load(tiny_dir("llama"))
    long_ids, short_ids = prompt(150, 1), prompt(20, 2)
    want = alone(model, short_ids, "full", 12, {})
    batch = Batch(model)
    batch.eos = set()
    long_row, short_row = row(model, long_ids, "full", 2, {}), row(model, short_ids, "full", 12, {})
    batch.join(long_row)
    batch.join(short_row)
    batch.step()
    assert int(batch.cache.layers[0].cursor) >= 150  # the short row padded to the long one's slots
    while len(batch):
        batch.step()
        if long_row.finish and len(batch):
            assert int(batch.cache.layers[0].cursor) <= 20 + len(short_row.tokens)
    assert short_row.tokens == want


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_bounded_rows_joining_and_leaving_get_their_lone_answers(tiny_dir, arch):
    """Rows with their own KV bounds (and one without) join and leave; each evicts on its own and
    gets what `generate(max_kv_tokens=...)` gives it alone, and no bounded row passes its bound."""
    from structkv.modules import DecodeBound

    model = structkv.load(tiny_dir(arch))
    plan = [(40, "full", 30, DecodeBound(24, "window")), (90, "snapkv", 25, DecodeBound(32, "redundancy")),
            (60, "full", 20, None), (30, "streaming_llm", 35, DecodeBound(20, "recent"))]
    prompts = [prompt(n, i) for i, (n, *_) in enumerate(plan)]
    want = []
    for p, (_, name, new, bound) in zip(prompts, plan):
        method = None if name == "full" else methods.build(name, kv=0.5, struct=0.5)
        want.append(structkv.generate(model, p, method=method, max_new_tokens=new, compile=False, stop_at_eos=False,
                                      max_kv_tokens=bound).token_ids)
    batch = Batch(model)
    batch.eos = set()
    rows = []
    for p, (_, name, new, bound) in zip(prompts, plan):
        method = None if name == "full" else methods.build(name, kv=0.5, struct=0.5)
        rows.append(Row(start(model, p, max_new_tokens=new, method=method, bound=bound), new, bound=bound))
    joins = {0: [0], 3: [1, 2], 10: [3]}
    ended, step = [], 0
    while len(ended) < len(rows):
        for i in joins.get(step, ()):
            batch.join(rows[i])
        ended += batch.step()
        if batch.cache is not None:
            live = [r for r in rows if r in batch.rows]
            for layer in batch.cache.layers:
                held = (layer.pos >= 0).sum(-1).amax(-1).tolist()
                assert all(n <= r.bound.max_tokens for n, r in zip(held, live) if r.bound is not None)
        step += 1
    assert [r.tokens for r in rows] == want


@pytest.mark.parametrize("arch,graphs", [("llama", 3), ("gemma3_text", 6)])
def test_compiled_batch_step_does_not_recompile_as_rows_join_and_leave(tiny_dir, arch, graphs):
    """Serve's compiled step keeps the row count and the cache's capacity symbolic: one graph per row
    class (1 row; 2 to SKINNY_ROWS; more), times ring-or-not for a hybrid model's sliding layers,
    serves every membership and length the schedule meets, and rows still get their lone answers."""
    from torch._dynamo.utils import counters

    model = structkv.load(tiny_dir(arch))
    rows, want = requests(model)
    batch = Batch(model, compile="eager")
    batch.eos = set()
    joins = {0: [0], 2: [1], 3: [2], 5: [3, 4]}
    before, shapes, step = counters["stats"]["unique_graphs"], set(), 0
    while step == 0 or len(batch):
        for i in joins.get(step, ()):
            batch.join(rows[i])
        batch.step()
        if batch.cache is not None:
            shapes.add(tuple(layer.k.shape[:3:2] for layer in batch.cache.layers))  # (rows, capacity) per layer
        step += 1
    assert [r.tokens for r in rows] == want
    assert len(shapes) >= 6  # a graph per shape would have compiled this many
    assert counters["stats"]["unique_graphs"] - before <= graphs


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 1e-12])
def test_a_tiny_temperature_is_greedy_and_harms_no_other_row(tiny_dir, temperature):
    """A temperature inside the API's range but so small that logits / t overflows float32 (it made
    `multinomial` raise, failing every row of the step) decodes as its limit, greedy, and the
    greedy row beside it gets its lone answer."""
    model = structkv.load(tiny_dir("llama"))
    ids = [prompt(30, 0), prompt(50, 1)]
    want = [alone(model, p, "full", 6, {}) for p in ids]
    batch = Batch(model)
    batch.eos = set()
    rows = [row(model, ids[0], "full", 6, {"temperature": temperature, "seed": 1}), row(model, ids[1], "full", 6, {})]
    for r in rows:
        batch.join(r)
    while len(batch):
        batch.step()
    assert [r.tokens for r in rows] == want


@settings(max_examples=15, deadline=None)
@given(st.floats(min_value=0, max_value=2), st.one_of(st.none(), st.floats(min_value=1e-6, max_value=1)),
       st.integers(0, 2**64 - 1))
def test_any_accepted_sampling_beside_a_greedy_row_never_changes_it(tiny_llama, temperature, top_p, seed):
    """Whatever accepted sampling a request asks for, the step never raises and the greedy request
    decoding beside it gets exactly its lone answer."""
    ids = [prompt(30, 3), prompt(40, 4)]
    want = alone(tiny_llama, ids[1], "full", 5, {})
    batch = Batch(tiny_llama)
    batch.eos = set()
    rows = [row(tiny_llama, ids[0], "full", 5, {"temperature": temperature, "top_p": top_p, "seed": seed}),
            row(tiny_llama, ids[1], "full", 5, {})]
    for r in rows:
        batch.join(r)
    while len(batch):
        batch.step()
    assert rows[1].tokens == want and len(rows[0].tokens) == 5


@pytest.fixture(scope="module")
def tiny_llama(tiny_dir):
    return structkv.load(tiny_dir("llama"))


@pytest.mark.parametrize("where", ["callback", "sampling"])
def test_a_row_that_fails_ends_alone_and_the_others_go_on(tiny_llama, monkeypatch, where):
    """A failure in one row's own work (its token callback raising, or its sampling) ends that row
    with `finish == "error"` and its exception; the rows beside it keep their lone answers (one
    failure used to end the whole step, every row answered 500)."""
    import structkv.serve.batcher as batcher

    ids = [prompt(30, 5), prompt(40, 6), prompt(35, 7)]
    want = [alone(tiny_llama, p, "full", 6, {}) for p in ids]
    batch = Batch(tiny_llama)
    batch.eos = set()
    rows = [row(tiny_llama, p, "full", 6, {}) for p in ids]
    calls = []

    def bad_callback(token):
        calls.append(token)
        if len(calls) == 3:
            raise RuntimeError("a client's stream broke")

    if where == "callback":
        rows[1].on_token = bad_callback
    else:
        real = batcher.sample

        def failing(logits, temperature, top_k, top_p, generator):
            if temperature == 0.5:
                raise RuntimeError("sampling failed")
            return real(logits, temperature, top_k, top_p, generator)

        monkeypatch.setattr(batcher, "sample", failing)
        rows[1].temperature = 0.5
    for r in rows:
        batch.join(r)
    ended = []
    while len(batch):
        ended += batch.step()
    assert rows[1].finish == "error" and isinstance(rows[1].error, RuntimeError)
    assert rows[1] in ended
    assert [rows[0].tokens, rows[2].tokens] == [want[0], want[2]]
