"""structkv against llama.cpp on the same GGUF file, the same threads, in one run, alternating.

For each prompt length, llama.cpp's own `llama-bench` measures prefill (`-p N -n 0`) and decode
at that depth (`-p 0 -n T -d N`), then structkv measures the same with every `--weights` setting
and every method (full cache, and compressed ones at R_KV `--kv-budget`), then the next length:
machine noise spreads over both sides instead of landing on one. Ratios are structkv's figure
over llama.cpp's of the same run.

    python benchmarks/llama_cpp_side_by_side.py --llama-bench /path/to/llama-bench \
        --model gemma-3-270m --lengths 1024,4096,8192 --weights fp32,int8,int4 --threads 2 \
        --out research/results/bench/llama_cpp_gemma

llama.cpp is not a dependency: build `llama-bench` from the sources in llama-cpp-python's sdist
(how: research/benchmarks_log.md, "Against llama.cpp"). Writes rows.jsonl (one object per measurement,
appended as it goes, so a stopped run keeps what it measured), table.md and speed.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# llama.cpp's KV cache types for structkv's `kv_dtype` (its quantized V cache needs flash attention;
# its default is f16, the 16-bit cache structkv's "bf16" is compared with)
LLAMA_KV = {None: (), "bf16": (), "int8": ("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"),
            "int4": ("-ctk", "q4_0", "-ctv", "q4_0", "-fa", "1")}


# the KV column: what each side stores (structkv's None is the model's dtype, float32 here)
KV_LABELS = {False: {None: "fp32", "bf16": "bf16", "int8": "int8", "int4": "int4"},
             True: {None: "f16", "bf16": "f16", "int8": "q8_0", "int4": "q4_0"}}


def llama_bench(binary: str, gguf: str, threads: int, length: int, new_tokens: int, repeats: int,
                kv_dtype: str | None = None) -> dict:
    """llama.cpp's prefill of `length` tokens (s) and decode at depth `length` (tokens/s), with its
    KV cache quantized like structkv's `kv_dtype` (q8_0 for int8, q4_0 for int4)."""
    def run(*flags) -> dict:
        cmd = [binary, "-m", gguf, "-t", str(threads), "-r", str(repeats), "-o", "json", *LLAMA_KV[kv_dtype], *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"llama-bench failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
        return json.loads(done.stdout)[0]

    pp = run("-p", str(length), "-n", "0")
    tg = run("-p", "0", "-n", str(new_tokens), "-d", str(length))
    return {"prefill_s": length / pp["avg_ts"], "decode_tokens_per_s": tg["avg_ts"],
            "build": pp.get("build_commit"), "cpu": pp.get("cpu_info"), "backend": pp.get("backends")}


def gguf_path(model: str) -> str:
    from structkv.models.loading import SMOLLM2_GGUF, _gemma_270m_path, fetch

    if model == "gemma-3-270m":
        return str(_gemma_270m_path())
    if model in ("smollm2", "smollm2-135m-instruct"):
        return str(fetch(SMOLLM2_GGUF)[0])
    if model.endswith(".gguf"):
        return model
    raise SystemExit(f"{model!r}: pass a .gguf file or an alias with a GGUF (gemma-3-270m, smollm2)")


def structkv_rows(models: dict, length: int, methods: list[str], args) -> list[dict]:
    from structkv.harness.bench import BenchConfig, make_method, measure, prompt_ids

    rows = []
    for weights, model in models.items():
        cfg = BenchConfig(model=args.model, methods=methods, lengths=[length], kv_budget=args.kv_budget,
                          struct_budget=args.struct_budget, new_tokens=args.new_tokens, repeats=args.repeats,
                          warmup=1, hf=False, weights=weights, compile=not args.eager, kv_dtype=args.kv_dtype)
        ids = prompt_ids(model, length, 0)
        for name in methods:
            r = measure(model, ids, make_method(cfg, name), cfg)
            rows.append({"side": "structkv", "weights": weights, "method": name, "tokens": length, "kv": args.kv_dtype,
                         "prefill_s": r["prefill_s"]["median"],
                         "decode_tokens_per_s": r["decode_tokens_per_s"]["median"],
                         "prefill_fraction": r["prefill_fraction"], "kv_bytes": r["kv_cache_bytes_after_decode"]})
            print(f"{length:>6} structkv {weights:>5} {name:>9}: prefill {rows[-1]['prefill_s']:.2f} s, decode "
                  f"{rows[-1]['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one line per (length, weights, method), llama.cpp's line first, ratios against it."""
    lines = ["| tokens | engine | weights | KV | method | prefill s | prefill speed vs llama.cpp | decode tok/s | "
             "decode vs llama.cpp |", "|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["tokens"] for r in rows}):
        ref = next((r for r in rows if r["tokens"] == n and r["side"] == "llama.cpp"), None)
        for r in (x for x in rows if x["tokens"] == n):
            pre = f"{ref['prefill_s'] / r['prefill_s']:.2f}x" if ref else ""
            dec = f"{r['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.2f}x" if ref else ""
            engine = "llama.cpp" if r["side"] == "llama.cpp" else "structkv"
            kv = KV_LABELS[r["side"] == "llama.cpp"][r.get("kv")]
            lines.append(f"| {n} | {engine} | {r.get('weights', 'gguf')} | {kv} | {r.get('method', 'full')} | "
                         f"{r['prefill_s']:.2f} | {pre} | {r['decode_tokens_per_s']:.1f} | {dec} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["side"], r.get("weights", "gguf"), r.get("method", "full")) for r in rows})
    for side, weights, method in series:
        pts = sorted((r["tokens"], r) for r in rows if (r["side"], r.get("weights", "gguf"),
                                                          r.get("method", "full")) == (side, weights, method))
        label = "llama.cpp (GGUF)" if side == "llama.cpp" else f"structkv {weights} {method}"
        style = dict(color="black", linewidth=2.5) if side == "llama.cpp" else {}
        axes[0].plot([n for n, _ in pts], [r["prefill_s"] for _, r in pts], marker="o", label=label, **style)
        axes[1].plot([n for n, _ in pts], [r["decode_tokens_per_s"] for _, r in pts], marker="o", label=label,
                     **style)
    axes[0].set(xlabel="prompt tokens", ylabel="prefill s (lower is better)", xscale="log", yscale="log")
    axes[1].set(xlabel="context tokens", ylabel="decode tokens/s (higher is better)", xscale="log")
    axes[1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="path to llama.cpp's llama-bench")
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--weights", default="fp32,int8,int4")
    ap.add_argument("--methods", default="full,structkv,snapkv")
    ap.add_argument("--kv-budget", type=float, default=0.1)
    ap.add_argument("--struct-budget", type=float, default=0.2)
    ap.add_argument("--kv-dtype", default=None, choices=[None, "bf16", "int8", "int4"],
                    help="KV entries on both sides: bf16 (llama.cpp: its default f16), int8 / int4 (llama.cpp: q8_0 / "
                         "q4_0 with flash attention); default the model's floats (llama.cpp: f16)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="structkv without torch.compile (checks, not speed)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--table", action="store_true", help="only rewrite table.md and speed.png from rows.jsonl")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sink = out / "rows.jsonl"
    if not args.table:
        if not args.llama_bench or not Path(args.llama_bench).is_file():
            raise SystemExit("pass --llama-bench (or set LLAMA_BENCH) to a llama-bench binary; "
                             "research/benchmarks_log.md says how to build one")
        import torch

        import structkv

        torch.set_num_threads(args.threads)
        gguf = gguf_path(args.model)
        models = {w: structkv.load(args.model, weights=w, kv_dtype=args.kv_dtype) for w in args.weights.split(",")}
        meta = {"side": "meta", "model": args.model, "gguf": gguf, "threads": args.threads, "torch": torch.__version__,
                "structkv": structkv.__version__, "command": " ".join(sys.argv), "started": time.ctime()}
        with sink.open("a") as f:
            f.write(json.dumps(meta) + "\n")
        for n in (int(x) for x in args.lengths.split(",")):
            ref = {"side": "llama.cpp", "tokens": n, "kv": args.kv_dtype,
                   **llama_bench(args.llama_bench, gguf, args.threads, n, args.new_tokens, args.repeats, args.kv_dtype)}
            print(f"{n:>6} llama.cpp: prefill {ref['prefill_s']:.2f} s, decode {ref['decode_tokens_per_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
            rows = [ref] + structkv_rows(models, n, args.methods.split(","), args)
            with sink.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    rows = [json.loads(line) for line in sink.read_text().splitlines() if line.strip()]
    meta = [r for r in rows if r["side"] == "meta"]
    rows = [r for r in rows if r["side"] != "meta"]
    (out / "table.md").write_text(table(rows))
    plot(rows, out / "speed.png", f"{meta[-1]['model'] if meta else ''}, {meta[-1]['threads'] if meta else '?'} "
                                   "threads, one run")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
