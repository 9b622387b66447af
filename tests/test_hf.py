"""structkv.hf: the methods on transformers models, differential against structkv's decoder on the
same weights: the same kept entries (exactly) and the same greedy tokens, question inside and after
the compressed text; unsupported methods and models are refused clearly."""
import pytest
import torch
from conftest import make_hf_model

import structkv
from structkv import methods

pytest.importorskip("transformers")
hf = pytest.importorskip("structkv.hf")

METHODS = ["snapkv", "pyramidkv", "keydiff", "expected_attention", "streaming_llm", "h2o", "full",
           "structkv_agnostic_union",
           "structkv", "structkv_paper", "fastkv", "gemfilter"]  # the last four prune tokens between layers


def _ids(n, seed=0):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tiny_dir):
    """(transformers model, structkv decoder) on one set of weights."""
    return make_hf_model(request.param), structkv.load(tiny_dir(request.param))


def _method(name):
    return methods.get(name) if name == "full" else methods.get(name, kv_budget=0.3)


@pytest.mark.parametrize("name", METHODS)
def test_same_entries_and_tokens_as_structkvs_decoder(pair, name):
    model, ours = pair
    ids, question = _ids(80), _ids(6, 1)
    state = hf.compress(model, None, ids, _method(name))
    mine = structkv.prefill(ours, ids, _method(name), room=32)
    for kept, layer in zip(state.kept, mine.cache.layers):
        used = int(layer.cursor)
        assert torch.equal(kept.sort(-1).values, layer.pos[:, :, :used].sort(-1).values)
    assert torch.allclose(state.logits, mine.logits, atol=1e-5)
    assert state.stats["prefill_fraction"] == pytest.approx(mine.stats.prefill_fraction)  # the same tokens computed
    if name in ("structkv", "structkv_paper", "fastkv"):
        assert state.stats["tokens_per_layer"] == mine.stats.tokens_per_layer
        assert state.stats["prefill_fraction"] < 1.0  # past the pivot only the kept tokens are computed
    inside = hf.generate(model, None, ids, method=_method(name), max_new_tokens=10, stop_at_eos=False)
    assert inside["token_ids"] == structkv.generate(ours, ids, method=_method(name), max_new_tokens=10,
                                                    stop_at_eos=False, compile=False).token_ids
    after = hf.generate(model, None, question, state=state, max_new_tokens=10, stop_at_eos=False)
    assert after["token_ids"] == structkv.generate(ours, question, state=mine, max_new_tokens=10, stop_at_eos=False,
                                                   compile=False).token_ids
    again = hf.generate(model, None, question, state=state, max_new_tokens=10, stop_at_eos=False)
    assert again == after  # the state is not modified by a question


def test_each_layer_is_cut_to_its_kept_entries_as_the_prefill_runs(pair):
    """A post-prefill method scores a layer inside its attention call and cuts that layer's cache
    right after it: when layer i runs, layer i - 1 already holds only its kept entries (the whole
    prompt's K/V of every layer never sit in memory together, as with kvpress's hooks)."""
    model, _ = pair
    ids, seen = _ids(80), {}
    hf.compress(model, None, ids[:8], "snapkv")  # attached (its hooks first)

    def before(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if module.layer_idx > 0:
            seen[module.layer_idx] = cache.layers[module.layer_idx - 1].keys.shape[-2]
    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    handles = [m.register_forward_pre_hook(before, with_kwargs=True) for m in attn]
    try:
        state = hf.compress(model, None, ids, _method("snapkv"))
    finally:
        for h in handles:
            h.remove()
    kept = state.cache.layers[0].keys.shape[-2]
    assert kept < len(ids) and seen == {i: kept for i in range(1, len(attn))}


def test_unsupported_methods_and_models_are_refused(pair):
    model, _ = pair
    with pytest.raises(ValueError, match="extra passes"):
        hf.compress(model, None, _ids(40), "kvzip")
    gemma = make_hf_model("gemma3_text")
    with pytest.raises(ValueError, match="sliding-window layers"):
        hf.compress(gemma, None, _ids(40), "snapkv")
    with pytest.raises(ValueError, match="give a tokenizer"):
        hf.compress(model, None, "some text", "snapkv")
