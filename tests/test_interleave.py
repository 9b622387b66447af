"""Chunked prefill: a layer run in slices equals the whole layer, every method's prefill through it
equals its own, and the pause between slices runs the decode steps (and stops a prefill)."""
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.models.decoder import run_block
from structkv.models.sliced import sliced_block
from structkv.runtime.compress import compress
from structkv.serve.interleave import Interleave, Stopped


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "mistral"])
def model(request, tiny_dir):
    return structkv.load(tiny_dir(request.param))


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def scorable(request, tiny_dir):
    """A model compression can score (Mistral's tiny config is all sliding windows)."""
    return structkv.load(tiny_dir(request.param))


@given(rows=st.integers(1, 40), length=st.integers(2, 60), pad=st.integers(0, 5), drop=st.integers(0, 3))
def test_a_sliced_layer_equals_the_whole_layer(model, rows, length, pad, drop):
    """Any slice size, left padding and a propagated subset (positions with gaps): the same h, q, k, v."""
    g = torch.Generator().manual_seed(length * 7 + rows)
    pos = torch.arange(length)[None]
    pos = torch.where(torch.arange(length) % 4 == 3, -1, pos) if drop else pos  # gaps, then dropped below
    pos = pos[pos >= 0][None]
    pos = torch.cat([torch.full((1, pad), -1), pos], 1)  # (1, pad + n)
    pos = torch.cat([pos, torch.cat([torch.full((1, pad + 1), -1), pos[:, :-pad - 1]], 1)]) if pos.shape[1] > pad + 1 \
        else pos  # a second, shorter row
    h = torch.randn(pos.shape[0], pos.shape[1], model.config.hidden_size, generator=g)
    pauses = []
    for i, layer in enumerate(model.model.layers):
        cos, sin = model.rope_tables(pos)[model.config.layer_types[i]]
        want = run_block(layer, h, pos, cos, sin)
        got = sliced_block(lambda: pauses.append(i), rows)(layer, h, pos, cos, sin)
        real = (pos >= 0)[..., None]  # a padding token's output is never read
        torch.testing.assert_close(torch.where(real, got[0], 0), torch.where(real, want[0], 0), rtol=1e-4, atol=1e-5)
        for a, b in zip(got[1:], want[1:]):
            torch.testing.assert_close(a, b)
    assert len(pauses) == len(model.model.layers) * 2 * -(-pos.shape[1] // rows)  # projections, then attention


@pytest.mark.parametrize("name", ["full", "snapkv", "structkv", "fastkv", "structkv_agnostic_union", "gemfilter"])
def test_every_method_prefills_the_same_through_slices(scorable, name):
    model = scorable
    tokens = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(48)[None]
    method = methods.get(name) if name == "full" else methods.get(name, kv_budget=0.4)
    want = compress(model, tokens, positions, method, room=8)
    got = compress(model, tokens, positions, method, room=8, block=sliced_block(lambda: None, 7))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(got.cache.layers, want.cache.layers):
        assert torch.equal(a.pos, b.pos)  # the same kept entries


def test_a_sliced_full_prefill_fills_the_same_cache(model):
    from structkv.runtime.generation import start

    prompt = list(range(3, 40))
    want = start(model, prompt, max_new_tokens=6)
    got = start(model, prompt, max_new_tokens=6, block=sliced_block(lambda: None, 5))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(got.cache.layers, want.cache.layers):
        torch.testing.assert_close(a.k, b.k, rtol=1e-4, atol=1e-5)


def test_the_pause_runs_a_step_once_a_slice_has_had_its_time_and_a_stop_ends_the_prefill():
    clock = {"budget": 0.0}
    steps, stop = [], threading.Event()
    pause = Interleave(lambda: steps.append(1), lambda: clock["budget"], stop=stop.is_set)
    for _ in range(3):
        pause()
    assert len(steps) == 3 == pause.steps  # budget 0: every pause point steps
    clock["budget"] = float("inf")  # nothing running: the prefill runs through
    pause()
    assert len(steps) == 3
    stop.set()
    with pytest.raises(Stopped):
        pause()


def test_a_prefill_through_the_pause_steps_between_its_slices(scorable):
    """The steps run inside the prefill, between its slices, and the prefill's result is unchanged."""
    model = scorable
    tokens = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(40)[None]
    method = methods.get("snapkv", kv_budget=0.4)
    order = []
    pause = Interleave(lambda: order.append("step"), lambda: 0.0)
    block = sliced_block(lambda: (order.append("slice"), pause()), 8)
    got = compress(model, tokens, positions, method, room=8, block=block)
    want = compress(model, tokens, positions, method, room=8)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    assert order[:4] == ["slice", "step", "slice", "step"] and order.count("step") == pause.steps > 0


def test_bad_slice_sizes_are_refused():
    for rows in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="rows per slice"):
            sliced_block(lambda: None, rows)
