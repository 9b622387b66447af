"""`structkv bench`: prefill, decode, memory and overhead per method and context length, side by side.

Every figure comes from one process and one model: the full-cache structkv decoder, each
compression method, and (optionally) transformers' sdpa model holding the same weights, so the
ratios compare like with like. Per (length, method): warm-up calls (not timed), then `repeats`
timed calls of `generate`; medians and min/max are reported. Times on CUDA are taken after a
synchronisation. Peak memory is the growth over the pre-call level (`peak_bytes`) and the absolute
peak (`peak_total_bytes`, weights included): resident set size sampled every 2 ms on CPU,
`torch.cuda.max_memory_allocated` on CUDA.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import methods as methods_registry
from ..modules.budget import Budget
from ..runtime.generation import generate
from ..util.timing import sync
from . import environment, pyplot


@dataclass
class BenchConfig:
    model: str = "gemma-3-270m"
    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "fastkv", "structkv"])
    lengths: list[int] = field(default_factory=lambda: [4096])
    kv_budget: float = 0.1
    struct_budget: float = 0.2
    # StructKV's pivot for every structkv* method: None (each method's own), "dynamic" or a depth
    # fraction (random weights have no attention structure to detect)
    pivot: str | float | None = None
    new_tokens: int = 32
    repeats: int = 3
    warmup: int = 1
    hf: bool = True  # transformers (sdpa) on the same weights
    dtype: str | None = None
    device: str = "cpu"
    compile: bool = True
    seed: int = 0
    int8_head: bool = False  # decode from the exact int8 copy of the LM head (GGUF Q8_0 heads)
    weights: str = "fp32"  # projections stored as fp32, bf16, int8 or int4 (structkv.models.quantized)
    kv_dtype: str | None = None  # KV entries: the model's floats, int8 or int4 (structkv.ops.kv_quant)
    tp: int | None = None  # tensor-parallel degree, under torchrun (each rank reports its own KV bytes)

    def __post_init__(self):  # budgets parsed once, where the config is made
        self.kv_budget = Budget.parse(self.kv_budget, "kv_budget").value
        self.struct_budget = Budget.parse(self.struct_budget, "struct_budget").value

    def validate(self):
        valid = methods_registry.names()
        for m in self.methods:
            if m not in valid:
                raise ValueError(f"unknown method {m!r}; valid: {', '.join(valid)}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        if self.new_tokens < 2:
            raise ValueError("new_tokens must be >= 2 to measure decoding")
        if self.tp not in (None, 1) and self.hf:
            raise ValueError("--tp runs only structkv's decoder: add --no-hf (transformers is not sharded here)")


def _release_freed_memory() -> None:
    """Return the C heap's free pages to the OS (glibc), so RSS growth measures this call alone."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: growth may then be understated
        pass


class PeakMemory:
    """Peak memory growth (bytes) during a `with` block."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        _release_freed_memory()  # else memory freed by earlier calls stays resident and hides the growth
        self.base = self._rss()
        self.top, self.running = self.base, True

        def sample():
            while self.running:
                self.top = max(self.top, self._rss())
                time.sleep(0.002)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.total = torch.cuda.max_memory_allocated(self.device)
        else:
            self.running = False
            self.thread.join()
            self.total = max(self.top, self._rss())
        self.peak = self.total - self.base
        return False


def make_method(cfg: BenchConfig, name: str):
    pivot = {}
    if cfg.pivot is not None and methods_registry.takes(name, "pivot"):
        pivot = {"pivot": "dynamic" if cfg.pivot == "dynamic" else float(cfg.pivot)}
    return methods_registry.build(name, kv=cfg.kv_budget, struct=cfg.struct_budget, **pivot)


def prompt_ids(model, length: int, seed: int) -> list[int]:
    """Exactly `length` tokens: essay text for a model with a tokenizer, seeded random ids otherwise."""
    if model.tokenizer is not None:
        from .eval.sources import essay_text

        text = essay_text()
        ids = model.tokenizer.encode(text[: length * 8])
        while len(ids) < length:  # long contexts: repeat the essays
            text += " " + text
            ids = model.tokenizer.encode(text[: length * 8])
        return ids[:length]
    gen = torch.Generator().manual_seed(seed + length)
    return torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()


def full_kv_bytes(model, n: int, layers=None) -> int:
    """K+V bytes an uncompressed cache holds for an n-token prompt (sliding layers: their window)."""
    cfg = model.config
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    layers = range(cfg.num_layers) if layers is None else layers
    return sum(per_token * min(n, cfg.sliding_window_at(i) or n) for i in layers)


def _summary(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(model, ids, method, cfg: BenchConfig) -> dict:
    for _ in range(cfg.warmup):
        generate(model, ids, max_new_tokens=cfg.new_tokens, method=method, stop_at_eos=False, compile=cfg.compile,
                 timing=True)
    runs = []
    for _ in range(cfg.repeats):
        with PeakMemory(model.device) as mem:
            out = generate(model, ids, max_new_tokens=cfg.new_tokens, method=method, stop_at_eos=False,
                           compile=cfg.compile, timing=True)  # phase times: the method's overhead
        s = out.stats
        overhead = s.get("scoring_s", 0.0) + s.get("selection_s", 0.0)
        runs.append({"prefill_s": s["prefill_s"], "decode_tokens_per_s": s["decode_tokens_per_s"],
                     "peak_bytes": mem.peak, "peak_total_bytes": mem.total, "overhead_s": overhead,
                     "scoring_s": s.get("scoring_s", 0.0),
                     "selection_s": s.get("selection_s", 0.0), "stats": s})
    s = runs[-1]["stats"]
    n, cfg_m = len(ids), model.config
    kv_full_layers = s.get("kv_bytes_full_layers", full_kv_bytes(model, n, cfg_m.full_attention_layers))
    kv_prefill = s.get("kv_bytes", full_kv_bytes(model, n))
    budget_bytes = None
    if getattr(method, "kv_budget", None) is not None:  # the budget in entries: floor(R_KV * n) per head and layer
        kept = Budget(method.kv_budget).tokens([n])[0]
        budget_bytes = full_kv_bytes(model, min(kept, n), cfg_m.full_attention_layers)
    return {
        "method": s["method"], "tokens": n,
        "prefill_s": _summary([r["prefill_s"] for r in runs]),
        "decode_tokens_per_s": _summary([r["decode_tokens_per_s"] for r in runs]),
        "peak_bytes": _summary([r["peak_bytes"] for r in runs]),
        "peak_total_bytes": max(r["peak_total_bytes"] for r in runs),  # process RSS / CUDA allocated, weights included
        "overhead_s": _summary([r["overhead_s"] for r in runs]),
        "overhead_share": statistics.median(r["overhead_s"] / r["prefill_s"] for r in runs),
        "scoring_s": statistics.median(r["scoring_s"] for r in runs),
        "selection_s": statistics.median(r["selection_s"] for r in runs),
        "prefill_fraction": s.get("prefill_fraction", 1.0),
        "tokens_per_layer": s.get("tokens_per_layer", [n] * cfg_m.num_layers),
        "pivot_layer": s.get("pivot_layer"),
        "kv_bytes": kv_prefill, "kv_bytes_full_layers": kv_full_layers,
        "kv_budget_bytes": budget_bytes,
        "kv_vs_budget": kv_full_layers / budget_bytes if budget_bytes else None,
        "kv_cache_bytes_after_decode": s["kv_cache_bytes"],
    }


# ------------------------------------------------------------------------------ transformers


def hf_twin(model):
    """transformers' model (sdpa) for our config, holding exactly our weights."""
    import transformers

    c = model.config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  tie_word_embeddings=c.tie_word_embeddings, attn_implementation="sdpa")
    if c.model_type == "gemma3_text":
        hf_cfg = transformers.Gemma3TextConfig(
            **common, sliding_window=c.sliding_window, layer_types=list(c.layer_types),
            query_pre_attn_scalar=c.head_dim,
            rope_parameters={t: {"rope_type": "default", "rope_theta": r.theta} for t, r in c.rope.items()})
    elif c.model_type in ("llama", "qwen2"):
        rope = next(iter(c.rope.values()))
        params = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
        if rope.rope_type == "llama3":
            params.update(factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                          high_freq_factor=rope.high_freq_factor,
                          original_max_position_embeddings=rope.original_max_position_embeddings)
        elif rope.rope_type == "linear":
            params.update(factor=rope.factor)
        cls = transformers.LlamaConfig if c.model_type == "llama" else transformers.Qwen2Config
        hf_cfg = cls(**common, rope_parameters=params)
    else:
        raise ValueError(f"no transformers twin for {c.model_type}; run with --no-hf")
    with torch.device(model.device):  # random init, then replaced by our tensors (buffers stay computed)
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=model.dtype)
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("inv_freq")}
    if c.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
    hf.load_state_dict(ours, strict=False, assign=True)
    if c.tie_word_embeddings:
        hf.tie_weights()
    for name, buf in hf.named_buffers():  # RoPE frequencies are computed, not loaded
        if buf.is_meta:
            raise RuntimeError(f"transformers twin left buffer {name} on the meta device")
    return hf.eval()


def check_twin(model, hf) -> float:
    """Max relative logit difference between our decoder and the transformers twin on 64 tokens."""
    ids = torch.arange(64, device=model.device)[None] * 7 % model.config.vocab_size
    with torch.inference_mode():
        ours, theirs = model(ids).float(), hf(ids).logits.float()
    rel = ((ours - theirs).abs().max() / ours.abs().max()).item()
    tol = 1e-3 if model.dtype == torch.float32 else 5e-2
    if not rel <= tol:
        raise RuntimeError(f"the transformers twin disagrees with structkv (relative logit difference {rel:.2e}); "
                           "its timings would not be comparable")
    return rel


def _cache_kw(hf) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.x; use whichever this version takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def measure_hf(hf, ids, cfg: BenchConfig, device) -> dict:
    tokens = torch.tensor([ids], device=device)
    kw = _cache_kw(hf)

    def once():
        t0 = time.perf_counter()
        out = hf(tokens, use_cache=True, logits_to_keep=1)
        sync(device)
        t1 = time.perf_counter()
        cache, tok = getattr(out, kw), out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(cfg.new_tokens - 1):
            out = hf(tok, use_cache=True, **{kw: cache})
            cache, tok = getattr(out, kw), out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        return t1 - t0, (cfg.new_tokens - 1) / (time.perf_counter() - t1)

    with torch.inference_mode():
        for _ in range(cfg.warmup):
            once()
        runs = []
        for _ in range(cfg.repeats):
            with PeakMemory(device) as mem:
                prefill, rate = once()
            runs.append((prefill, rate, mem.peak))
    return {"method": "transformers", "tokens": len(ids), "prefill_s": _summary([r[0] for r in runs]),
            "decode_tokens_per_s": _summary([r[1] for r in runs]), "peak_bytes": _summary([r[2] for r in runs]),
            "prefill_fraction": 1.0}


# ------------------------------------------------------------------------------ run + report


def run(cfg: BenchConfig, out: str | Path | None = None, model=None, progress=True) -> dict:
    from ..models import load

    cfg.validate()
    model = model if model is not None else load(cfg.model, dtype=cfg.dtype, device=cfg.device, tp=cfg.tp)
    limit = model.config.max_position_embeddings
    for n in cfg.lengths:
        if n + cfg.new_tokens > limit:
            raise ValueError(f"length {n} + {cfg.new_tokens} new tokens exceeds the model's {limit} positions")
    hf = hf_twin(model) if cfg.hf else None  # built from the float weights, before quantize()
    twin_diff = check_twin(model, hf) if hf is not None else None
    model.quantize(cfg.weights)
    model.kv_dtype = cfg.kv_dtype
    if cfg.int8_head:
        model.use_int8_head()
    rows = []
    for n in cfg.lengths:
        ids = prompt_ids(model, n, cfg.seed)
        for name in cfg.methods:
            t = time.perf_counter()
            rows.append(measure(model, ids, make_method(cfg, name), cfg))
            if progress:
                r = rows[-1]
                print(f"{n:>6} tokens {name:>14}: prefill {r['prefill_s']['median']:.3f} s, decode "
                      f"{r['decode_tokens_per_s']['median']:.1f} tok/s, "
                      f"peak +{r['peak_bytes']['median'] / 2**20:.0f} MiB"
                      f" ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
        if hf is not None:
            rows.append(measure_hf(hf, ids, cfg, model.device))
            if progress:
                r = rows[-1]
                print(f"{n:>6} tokens   transformers: prefill {r['prefill_s']['median']:.3f} s, decode "
                      f"{r['decode_tokens_per_s']['median']:.1f} tok/s", file=sys.stderr, flush=True)
    result = {"config": asdict(cfg), "environment": environment(), "device": _device_name(model.device),
              "model": {"name": cfg.model, "type": model.config.model_type, "layers": model.config.num_layers,
                        "dtype": str(model.dtype), "weights": model.weights,
                        "kv_dtype": model.kv_dtype},
              "transformers_twin_rel_logit_diff": twin_diff,
              "rows": rows, "ratios": ratios(rows), "scaling": scaling(rows)}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result, indent=1))
        (out / "bench.md").write_text(markdown(result))
    return result


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def ratios(rows: list[dict]) -> list[dict]:
    """Per length and method: prefill speed-up and decode gain over the full cache and over transformers."""
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        at = {r["method"]: r for r in rows if r["tokens"] == n}
        full, hf = at.get("full"), at.get("transformers")
        for name, r in at.items():
            item = {"tokens": n, "method": name}
            for ref_name, ref in (("full", full), ("transformers", hf)):
                if ref is not None and ref is not r:
                    item[f"prefill_speedup_vs_{ref_name}"] = ref["prefill_s"]["median"] / r["prefill_s"]["median"]
                    item[f"decode_gain_vs_{ref_name}"] = (r["decode_tokens_per_s"]["median"]
                                                          / ref["decode_tokens_per_s"]["median"])
            out.append(item)
    return out


def _slope(xs, ys) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def scaling(rows: list[dict]) -> dict:
    """Growth exponent b of time ~ n^b and peak memory ~ n^b per method (least squares in log-log)."""
    out = {}
    for name in sorted({r["method"] for r in rows}):
        mine = sorted((r for r in rows if r["method"] == name), key=lambda r: r["tokens"])
        if len(mine) < 2:
            continue
        n = [r["tokens"] for r in mine]
        out[name] = {"prefill_time_exponent": _slope(n, [r["prefill_s"]["median"] for r in mine]),
                     "peak_memory_exponent": _slope(n, [r["peak_bytes"]["median"] for r in mine])}
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"# structkv bench: {result['model']['name']} ({result['model']['type']}, {result['model']['dtype']}) "
             f"on {result['device']}" + (f", tensor parallel {cfg['tp']} ranks: this rank's KV bytes"
                                          if cfg.get("tp") not in (None, 1) else ""),
             f"R_KV {cfg['kv_budget']}, R_struct {cfg['struct_budget']}, pivot {cfg['pivot']}, {cfg['new_tokens']} new "
             f"tokens, median of {cfg['repeats']} after {cfg['warmup']} warm-up\n",
             "| tokens | method | prefill s (min-max) | speed-up vs full | vs HF | decode tok/s | decode vs full | "
             "peak +MiB (total GiB) | KV MiB (full-attn layers) | KV / budget | prefill frac | pivot | overhead % |",
             "|" + "---|" * 13]
    rat = {(r["tokens"], r["method"]): r for r in result["ratios"]}
    for r in result["rows"]:
        q = rat[(r["tokens"], r["method"])]
        p = r["prefill_s"]

        def fmt(v, f="{:.2f}x"):
            return f.format(v) if v is not None else "-"

        lines.append(
            f"| {r['tokens']} | {r['method']} | {p['median']:.3f} ({p['min']:.3f}-{p['max']:.3f}) | "
            f"{fmt(q.get('prefill_speedup_vs_full'))} | {fmt(q.get('prefill_speedup_vs_transformers'))} | "
            f"{r['decode_tokens_per_s']['median']:.1f} | {fmt(q.get('decode_gain_vs_full'))} | "
            f"{r['peak_bytes']['median'] / 2**20:.0f} "
            f"({fmt(r.get('peak_total_bytes') and r['peak_total_bytes'] / 2**30, '{:.1f}')}) | "
            f"{fmt(r.get('kv_bytes_full_layers', None) and r['kv_bytes_full_layers'] / 2**20, '{:.1f}')} | "
            f"{fmt(r.get('kv_vs_budget'), '{:.3f}')} | {r['prefill_fraction']:.3f} | {r.get('pivot_layer', '-')} | "
            f"{fmt(r.get('overhead_share') and 100 * r['overhead_share'], '{:.2f}')} |")
    if result["scaling"]:
        lines += ["", "| method | prefill time exponent | peak memory exponent |", "|---|---|---|"]
        for name, s in result["scaling"].items():
            lines.append(f"| {name} | {s['prefill_time_exponent']:.2f} | "
                         f"{s['peak_memory_exponent']:.2f} |" if s["peak_memory_exponent"] is not None else
                         f"| {name} | {s['prefill_time_exponent']:.2f} | - |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path, eval_dir: str | None = None) -> list[str]:
    """Latency vs context length per method; with an eval folder, accuracy vs prefill time and KV bytes."""

    plt = pyplot()

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for res in results:
        tag = res["model"]["name"]
        for name in sorted({r["method"] for r in res["rows"]}):
            pts = sorted((r["tokens"], r["prefill_s"]["median"]) for r in res["rows"] if r["method"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{name} ({tag})" if len(results) > 1 else name)
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="prefill (time to first token), s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_length.png", dpi=120)
    plt.close(fig)
    written.append("latency_vs_length.png")
    if eval_dir:
        metrics = json.loads((Path(eval_dir) / "metrics.json").read_text())["rows"]
        res = results[0]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for row in metrics:
            speed = [r for r in res["rows"] if r["method"] == row["method"]]
            if not speed:
                continue
            r = min(speed, key=lambda r: abs(r["tokens"] - row["length"]))
            for ax, x in zip(axes, (r["prefill_s"]["median"], r.get("kv_bytes", 0) / 2**20)):
                ax.scatter(x, row["average"])
                ax.annotate(row["label"], (x, row["average"]), fontsize=7)
        axes[0].set(xlabel="prefill s (bench)", ylabel="average score (eval)")
        axes[1].set(xlabel="KV cache MiB after prefill", ylabel="average score (eval)")
        fig.tight_layout()
        fig.savefig(out / "pareto.png", dpi=120)
        plt.close(fig)
        written.append("pareto.png")
    return written
