"""The exact int8 LM head: recovery of Q8_0 blocks, logits against the float head, decode unchanged."""
import pytest
import torch

import structkv
from structkv.models.int8_head import Int8BlockHead
from structkv.ops.int8_head import BLOCK, int8_head_logits


def q8_matrix(V, E, seed=0):
    """A float matrix that is exactly Q8_0: fp16 block scales, int8 codes with +-127 in each block."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (V, E // BLOCK, BLOCK), generator=g, dtype=torch.int8)
    codes[:, :, 0] = torch.where(torch.rand(V, E // BLOCK, generator=g) < 0.5, 127, -127).to(torch.int8)
    scales = (torch.rand(V, E // BLOCK, generator=g) * 1e-2 + 1e-4).half().float()
    return (codes.float() * scales[..., None]).view(V, E), codes.view(V, E), scales


def test_recovers_q8_blocks_exactly():
    w, codes, scales = q8_matrix(96, 64)
    head = Int8BlockHead.from_weight(w)
    assert torch.equal(head.codes, codes) and torch.equal(head.scales, scales)
    assert torch.equal(head.dequantize(), w)


def test_refuses_a_float_matrix():
    with pytest.raises(ValueError, match="not exactly int8 blocks"):
        Int8BlockHead.from_weight(torch.randn(96, 64))
    with pytest.raises(ValueError, match="divisible by 32"):
        Int8BlockHead.from_weight(torch.randn(96, 48))


@pytest.mark.parametrize("rows", [1, 3])
def test_logits_equal_the_float_head(rows):
    w, _, _ = q8_matrix(200, 96, seed=1)
    head = Int8BlockHead.from_weight(w)
    h = torch.randn(rows, 96)
    torch.testing.assert_close(head.logits(h), h @ w.t(), rtol=1e-5, atol=1e-6)


def test_op_registration():
    w, codes, scales = q8_matrix(64, 64, seed=2)
    torch.library.opcheck(int8_head_logits, (torch.randn(1, 64), codes, scales))


@pytest.mark.parametrize("compile", [False, True])
def test_decode_is_unchanged(tiny_dir, compile):
    model = structkv.load(tiny_dir("llama"))
    w, _, _ = q8_matrix(*model.lm_head.weight.shape, seed=3)
    with torch.no_grad():
        model.lm_head.weight.copy_(w * 30)  # fp16 scale x 30 is still exact in fp32: the blocks stay Q8_0
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = structkv.generate(model, ids, max_new_tokens=12, stop_at_eos=False, compile=compile)
    assert model.use_int8_head() is model
    out = structkv.generate(model, ids, max_new_tokens=12, stop_at_eos=False, compile=compile)
    assert out.token_ids == ref.token_ids
    batch = structkv.generate(model, [ids, ids[:30]], max_new_tokens=6, stop_at_eos=False, compile=False)
    assert batch.token_ids[0] == ref.token_ids[:6]  # batches keep the float head


def test_gemma_head_is_exact_int8(gemma):
    """Gemma 3 270M's GGUF head is Q8_0: the int8 copy is exact and greedy decoding is unchanged."""
    prompt = "The capital of France is"
    ref = structkv.generate(gemma, prompt, max_new_tokens=8, compile=False)
    gemma.use_int8_head()
    try:
        assert torch.equal(gemma.int8_head.dequantize(), gemma.lm_head.weight)
        assert structkv.generate(gemma, prompt, max_new_tokens=8, compile=False).token_ids == ref.token_ids
    finally:
        gemma.int8_head = None


def test_cli_refuses_a_float_head(byte_model_dir, capsys):
    from structkv.cli import main

    assert main(["generate", "hello", "--model", str(byte_model_dir), "--int8-head", "--eager"]) == 2
    assert "not exactly int8 blocks" in capsys.readouterr().err
