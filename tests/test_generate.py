"""Generation: compiled == eager, one compile per generation, sampling, and bad input."""
import pytest
import torch
from conftest import ARCHS
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import structkv
from structkv.runtime.generation import compiled_prefill


def _ids(n, seed=0):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_equals_eager(arch, tiny_dir):
    model = structkv.load(tiny_dir(arch))
    eager = structkv.generate(model, _ids(21), max_new_tokens=20, stop_at_eos=False, compile=False)
    comp = structkv.generate(model, _ids(21), max_new_tokens=20, stop_at_eos=False, compile=True)
    assert comp.token_ids == eager.token_ids
    tokens = torch.tensor([_ids(21)])
    with torch.inference_mode():  # the grad mode generate() runs in: no extra recompile
        logits_comp, _ = compiled_prefill()(model, tokens, torch.arange(21)[None])
    logits_eager, _ = model.prompt_pass(tokens, torch.arange(21)[None])
    assert torch.allclose(logits_comp, logits_eager, atol=1e-4)


def test_one_compile_per_generation(tiny_dir):
    """Decode compiles once for a whole generation, prefill once for every prompt length."""
    torch._dynamo.reset()
    model = structkv.load(tiny_dir("gemma3_text"))
    counter = CompileCounterWithBackend("eager")
    for n in (9, 23, 40):  # same cache capacity bucket, three prompt lengths
        structkv.generate(model, _ids(n), max_new_tokens=16, stop_at_eos=False, compile=counter)
    assert counter.frame_count == 2  # one prefill graph + one decode graph


def test_one_token_prompt_goes_through_decode(tiny_dir):
    model = structkv.load(tiny_dir("llama"))
    out = structkv.generate(model, [7], max_new_tokens=5, stop_at_eos=False, compile=False)
    seq = [7]
    for _ in range(5):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out.token_ids == seq[1:]


def test_sampling_is_seeded_and_respects_top_k(tiny_dir):
    model = structkv.load(tiny_dir("qwen3"))
    a = structkv.generate(model, _ids(10), max_new_tokens=8, temperature=1.0, top_k=3, seed=4, compile=False,
                          stop_at_eos=False)
    b = structkv.generate(model, _ids(10), max_new_tokens=8, temperature=1.0, top_k=3, seed=4, compile=False,
                          stop_at_eos=False)
    assert a.token_ids == b.token_ids
    # top_k=1 is greedy whatever the temperature
    g = structkv.generate(model, _ids(10), max_new_tokens=8, compile=False, stop_at_eos=False)
    k1 = structkv.generate(model, _ids(10), max_new_tokens=8, temperature=2.0, top_k=1, seed=0, compile=False,
                           stop_at_eos=False)
    assert k1.token_ids == g.token_ids


def test_top_p_keeps_smallest_nucleus():
    from structkv.runtime.decoding import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, 1.0, None, 0.7, gen)) for _ in range(200)}
    assert seen == {0, 1}


def test_stops_at_eos(tiny_dir):
    model = structkv.load(tiny_dir("llama"))
    free = structkv.generate(model, _ids(12), max_new_tokens=10, stop_at_eos=False, compile=False)
    eos = free.token_ids[3]
    object.__setattr__(model.config, "eos_token_ids", (eos,))
    try:
        out = structkv.generate(model, _ids(12), max_new_tokens=10, compile=False)
    finally:
        object.__setattr__(model.config, "eos_token_ids", ())
    assert out.token_ids == free.token_ids[: free.token_ids.index(eos)]


def test_stop_checks_are_batched_but_steps_count_as_if_checked_every_step():
    """Decode asks the host whether every row stopped only every STOP_CHECK_EVERY steps: the rows
    are cut at their first EOS, `steps` ends where the last row stopped, and no more than one
    check's worth of steps runs past it."""
    from types import SimpleNamespace

    from structkv.runtime import decoding

    script = [[5, 6, 9, 7, 7, 7, 7, 7, 7, 7, 7, 7], [5, 5, 5, 5, 9, 7, 7, 7, 7, 7, 7, 7]]  # EOS = 9
    calls = []

    def logits_at(step):
        out = torch.zeros(2, 10)
        out[0, script[0][step]] = out[1, script[1][step]] = 1.0
        return out

    def decode(model, tok, pos, cache):
        calls.append(int(pos[0, 0]))
        return logits_at(len(calls))

    model = SimpleNamespace(config=SimpleNamespace(eos_token_ids=(9,)), tokenizer=None, device="cpu")
    rows = decoding.Decoding(model, None, logits_at(0), torch.zeros(2, 1, dtype=torch.long), decode)
    ids, steps = decoding.decode_tokens(rows, 12, 0.0, None, None, True, None)
    assert ids == [[5, 6], [5, 5, 5, 5]] and steps == 5
    assert len(calls) < decoding.STOP_CHECK_EVERY  # checked once, at the 8th step, not at every step


# ---------------------------------------------------------------------------- bad input
def test_empty_prompt(tiny_dir):
    model = structkv.load(tiny_dir("llama"))
    for bad in ([], [[1, 2], []]):
        with pytest.raises(ValueError, match="empty"):
            structkv.generate(model, bad, compile=False)


def test_prompt_longer_than_max_positions(tiny_dir):
    model = structkv.load(tiny_dir("llama"))
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        structkv.generate(model, _ids(250), max_new_tokens=10, compile=False)


def test_bad_tokens_and_options(tiny_dir):
    model = structkv.load(tiny_dir("llama"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        structkv.generate(model, [1, 2, 500], compile=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        structkv.generate(model, "hello", compile=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        structkv.generate(model, [1, 2], max_new_tokens=0, compile=False)
    with pytest.raises(ValueError, match="top_p"):
        structkv.generate(model, [1, 2], temperature=1.0, top_p=1.5, compile=False)
    with pytest.raises(ValueError, match="1-D integer"):
        structkv.generate(model, torch.tensor([1.0, 2.0]), compile=False)


def test_device_mismatch(tiny_dir):
    model = structkv.load(tiny_dir("llama"))
    with pytest.raises(ValueError, match="is on meta but the model is on cpu"):
        structkv.generate(model, torch.tensor([1, 2, 3], device="meta"), compile=False)


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=0, max_value=2), st.integers(0, 2**31 - 1), st.floats(min_value=0.01, max_value=1))
def test_sample_gives_a_token_at_every_temperature_in_range(temperature, seed, top_p):
    """Any temperature the API accepts gives a valid token per row (never NaN probabilities), and one
    below float32's smallest normal number gives the argmax, its limit."""
    from structkv.runtime.decoding import sample

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, generator=g) * 30
    for k, p in ((None, None), (5, None), (None, top_p)):
        tok = sample(logits, temperature, k, p, torch.Generator().manual_seed(seed))
        assert tok.shape == (3,) and ((0 <= tok) & (tok < 50)).all()
        if temperature < torch.finfo(torch.float32).tiny:
            assert torch.equal(tok, logits.argmax(-1))


def test_prefill_s_is_always_the_compression_and_the_question_has_its_own(tiny_dir):
    """From a state, `prefill_s` is the context's compression (the state's own figure), never the
    question's extension, which is `question_s`; without a state there is no question_s."""
    from structkv import methods

    model = structkv.load(tiny_dir("llama"))
    state = structkv.prefill(model, list(range(3, 90)), methods.get("snapkv", kv_budget=0.3), room=16)
    out = structkv.generate(model, [4, 5, 6], state=state, max_new_tokens=2, compile=False)
    assert out.stats["prefill_s"] == state.stats.prefill_s
    assert out.stats["question_s"] > 0
    alone = structkv.generate(model, list(range(3, 90)), max_new_tokens=2, compile=False)
    assert alone.stats["prefill_s"] > 0 and "question_s" not in alone.stats
    assert "question" in structkv.runtime.generation.format_stats(out.stats)
