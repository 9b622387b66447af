"""A probe is compression-time only: its queries score the context, then it leaves no trace.

At budget 1 a probed state is the full cache of the context (entries, next position, logits, and
the answer to a question asked after it); at any budget no entry of the probe stays, the stats
speak of the context, and a probed method shares a prefill pass with others exactly as alone.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structkv
from structkv import methods
from structkv.text.prompts import encode_batch

PROBE = "\n\nWhat does the text above say?"
CONTEXT = "The vault code is 4417. " + "Nothing happens in this long and quiet paragraph. " * 12


@pytest.fixture(scope="module")
def model(byte_model_dir):
    return structkv.load(byte_model_dir)


def test_probe_at_budget_one_is_the_full_cache(model):
    full = structkv.prefill(model, CONTEXT, None, room=32)
    probed = structkv.prefill(model, CONTEXT, methods.get("snapkv", kv_budget=1.0, probe=PROBE), room=32)
    assert torch.equal(probed.next_positions, full.next_positions)
    torch.testing.assert_close(probed.logits, full.logits, rtol=0, atol=1e-5)
    for a, b in zip(probed.cache.layers, full.cache.layers):
        assert sorted(a.pos[a.pos >= 0].tolist()) == sorted(b.pos[b.pos >= 0].tolist())
    question = " What is the vault code?"
    a = structkv.generate(model, question, state=probed, max_new_tokens=6, compile=False, stop_at_eos=False)
    b = structkv.generate(model, question, state=full, max_new_tokens=6, compile=False, stop_at_eos=False)
    assert a.token_ids == b.token_ids


@settings(max_examples=10)
@given(name=st.sampled_from(["snapkv", "pyramidkv", "fastkv", "structkv", "structkv_paper"]),
       budget=st.sampled_from([0.1, 0.3, 0.6]), probe=st.sampled_from([PROBE, " Summary:", "\nRepeat it.\n"]))
def test_no_probe_entry_stays_and_stats_speak_of_the_context(model, name, budget, probe):
    n = len(model.tokenizer.encode(CONTEXT))
    state = structkv.prefill(model, CONTEXT, methods.get(name, kv_budget=budget, probe=probe), room=8)
    assert int(state.next_positions) == n and state.stats.prompt_tokens == [n] and state.lengths == [n]
    assert max(int(layer.pos.max()) for layer in state.cache.layers) < n
    assert int(state.kept_columns.max()) < n
    assert state.method.probe == probe
    extra = len(model.tokenizer.encode(probe, add_bos=False))
    assert state.stats.tokens_per_layer[0] == n + extra  # the probe's prefill is counted


def test_probed_methods_share_a_pass_as_alone(model):
    tokens, positions, _ = encode_batch(model, [CONTEXT])
    group = [methods.get("snapkv", kv_budget=0.3), methods.get("snapkv", kv_budget=0.3, probe=PROBE),
             methods.get("structkv", kv_budget=0.3, probe=PROBE), methods.get("full")]
    shared = structkv.compress_shared(model, tokens, positions, group, room=8)
    for method, state in zip(group, shared):
        alone = structkv.compress(model, tokens, positions, method, room=8)
        assert state.method is method
        for x, y in zip(state.cache.layers, alone.cache.layers):
            assert torch.equal(x.pos, y.pos)
        torch.testing.assert_close(state.logits, alone.logits, rtol=0, atol=1e-5)


def test_bad_probes_are_refused(model, tiny_dir):
    with pytest.raises(ValueError, match="probe must be a non-empty text"):
        methods.get("snapkv", probe="  ")
    with pytest.raises(ValueError, match="probe must be a non-empty text"):
        methods.get("structkv", probe=3)
    untokenized = structkv.load(tiny_dir("llama"))
    with pytest.raises(ValueError, match="this model has no tokenizer"):
        structkv.prefill(untokenized, list(range(3, 40)), methods.get("snapkv", probe=PROBE))
