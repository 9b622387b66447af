"""Differential tests: structkv's decoder against transformers' own forward, per architecture."""
import pytest
import torch
from conftest import ARCHS, make_hf_model

import structkv

PROMPT_LEN = 24  # longer than the sliding window (8) of the tiny Mistral / Gemma 3 configs


def _prompt(n=PROMPT_LEN, seed=1):
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tiny_dir):
    hf = make_hf_model(arch)
    model = structkv.load(tiny_dir(arch))
    ids = _prompt()
    with torch.no_grad():
        ref = hf(ids).logits
    out = model(ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(arch, tiny_dir):
    hf = make_hf_model(arch)
    model = structkv.load(tiny_dir(arch))
    ids = _prompt()
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20, eos_token_id=None,
                          pad_token_id=0)[0, PROMPT_LEN:].tolist()
    ours = structkv.generate(model, ids[0].tolist(), max_new_tokens=20, stop_at_eos=False, compile=False)
    assert ours.token_ids == ref


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_bf16_close_to_fp32(arch, tiny_dir):
    ref = structkv.load(tiny_dir(arch))(_prompt())
    out = structkv.load(tiny_dir(arch), dtype=torch.bfloat16)(_prompt())
    assert out.dtype == torch.float32  # logits are returned in float32
    assert torch.allclose(out, ref, atol=0.1, rtol=0.05)


def test_subset_with_original_positions_sees_restricted_attention(tiny_dir):
    """A subset of tokens fed with their original positions attends exactly like the full sequence
    restricted to those keys (the contract the pruning methods rely on)."""
    from structkv.ops import visible

    model = structkv.load(tiny_dir("gemma3_text"))
    ids = _prompt()
    keep = torch.tensor([0, 2, 3, 7, 11, 12, 17, 20, 21, 22, 23])
    pos = keep[None]
    h_sub = model.embed(ids[:, keep])
    rope_sub = model.rope_tables(pos)
    full_pos = torch.arange(PROMPT_LEN)[None]
    h_full = model.embed(ids)
    rope_full = model.rope_tables(full_pos)
    # Layer 0 on the subset vs layer 0 on the full sequence with the dropped keys masked out.
    out_sub, _, k_sub, _ = model.model.layers[0](h_sub, pos, *rope_sub[model.config.layer_types[0]])
    block = model.model.layers[0]
    q, k, v = block.self_attn.qkv(block.input_layernorm(h_full), *rope_full[model.config.layer_types[0]])
    masked_pos = torch.full_like(full_pos, -1)
    masked_pos[0, keep] = keep
    mask = visible(full_pos, masked_pos, block.self_attn.sliding_window)
    out_full = block.finish(h_full, block.self_attn.attend(q, k, v, mask))
    assert torch.allclose(out_sub, out_full[:, keep], atol=1e-5)
    assert torch.allclose(k_sub, k[:, :, keep], atol=1e-6)


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen2"])
def test_batch_left_padding_equals_alone(arch, tiny_dir):
    model = structkv.load(tiny_dir(arch))
    prompts = [_prompt(n, seed=s)[0].tolist() for n, s in ((20, 2), (9, 3), (14, 4), (5, 5))]  # 5 < window
    batch = structkv.generate(model, prompts, max_new_tokens=12, stop_at_eos=False, compile=False)
    for p, got in zip(prompts, batch.token_ids):
        alone = structkv.generate(model, p, max_new_tokens=12, stop_at_eos=False, compile=False)
        assert got == alone.token_ids


def test_decode_logits_match_full_forward(tiny_dir):
    """Cached decoding gives the same next-token logits as re-running the whole sequence."""
    from structkv.models import StaticKVCache
    from structkv.text.prompts import encode_batch

    model = structkv.load(tiny_dir("mistral"))
    ids = _prompt(18)[0].tolist()
    tokens, positions, _ = encode_batch(model, [ids])
    cache = StaticKVCache(model.config, 1, 32, model.dtype, model.device)
    _, kv = model.prompt_pass(tokens, positions)
    for layer, (k, v) in zip(cache.layers, kv):
        layer.fill(k, v, positions)
    seq = list(ids)
    for step, tok in enumerate([5, 17, 42]):
        seq.append(tok)
        logits = model.decode_step(torch.tensor([[tok]]), torch.tensor([[18 + step]]), cache)
        ref = model(torch.tensor([seq]))[:, -1]
        assert torch.allclose(logits, ref, atol=1e-5)
