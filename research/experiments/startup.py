"""Start-up cost of `structkv generate` against transformers, side by side in one run.

Each "cold" row is a fresh process with an empty inductor cache (a new TORCHINDUCTOR_CACHE_DIR);
"warm" rows reuse the cache a previous row filled. structkv's GGUF conversion cache is warm in
every structkv row except the one that says otherwise. transformers loads the same GGUF
(`from_pretrained(..., gguf_file=...)`, dequantised on every load) and generates greedily:
"load and generate" is a fresh process; "warm call" is a second generate() in a process that
already ran one. "process s" is the whole command (Python start, imports, load, generate);
"generate call s" is the call alone (structkv: prefill + decode from its stats line).

    python research/experiments/startup.py                  # both cases, table on stdout
    python research/experiments/startup.py --out research/results/startup.md
    python research/experiments/startup.py --only decode    # what compiling the decode step costs and saves
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHORT = "The capital of France is"
HF_SCRIPT = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from structkv.models.loading import _gemma_270m_path
path = _gemma_270m_path()
prompt = open(sys.argv[1]).read()
new = int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
calls = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    calls.append(time.perf_counter() - t0)
text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
print(json.dumps({"calls": calls, "text": text, "prompt_tokens": ids.shape[1]}))
"""


def _run(cmd: list[str], env: dict, stdin: str | None = None) -> tuple[float, str, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, input=stdin)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return wall, proc.stdout, proc.stderr


def _structkv(prompt_file: str, new: int, mode: str, inductor: str, extra_env: dict | None = None) -> dict:
    """One `structkv generate` process: its wall time, its call time (prefill + decode, from the
    stats line) and the stats line."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, **(extra_env or {})}
    cmd = [sys.executable, "-m", "structkv.cli", "generate", "-f", prompt_file, "--max-new-tokens", str(new),
           "--compile", mode, "--no-stream"]
    wall, out, err = _run(cmd, env)
    stats = err.strip().splitlines()[-1]
    call = float(re.search(r"prefill ([\d.]+) s", stats)[1]) + float(re.search(r"tokens in ([\d.]+) s", stats)[1])
    return {"wall_s": wall, "call_s": call, "text": out.strip(), "stats": stats}


def _transformers(prompt_file: str, new: int, calls: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(HF_SCRIPT)
    wall, out, _ = _run([sys.executable, f.name, prompt_file, str(new), str(calls)], dict(os.environ))
    os.unlink(f.name)
    return {"wall_s": wall, **json.loads(out.strip().splitlines()[-1])}


def case(name: str, prompt_file: str, new: int) -> list[tuple[str, float, float | None, str]]:
    """Rows (what, process wall s, generate call s, detail). Eager rows are the faster of two
    processes (each with an empty compile cache), so one noisy process does not decide."""
    rows = []
    with tempfile.TemporaryDirectory() as cold:
        for mode in ("auto", "never"):
            r = min((_structkv(prompt_file, new, mode, tempfile.mkdtemp(dir=cold)) for _ in range(2)),
                    key=lambda r: r["wall_s"])
            rows.append((f"structkv generate --compile {mode}, new process, empty compile cache (best of 2)",
                         r["wall_s"], r["call_s"], r["stats"]))
        fresh = tempfile.mkdtemp(dir=cold)
        for state in ("empty", "warm"):
            r = _structkv(prompt_file, new, "always", fresh)
            rows.append((f"structkv generate --compile always, new process, {state} compile cache", r["wall_s"],
                         r["call_s"], r["stats"]))
        if name == "short":
            r = _structkv(prompt_file, new, "auto", tempfile.mkdtemp(dir=cold),
                          {"STRUCTKV_CACHE": tempfile.mkdtemp(dir=cold)})
            rows.append(("structkv generate (auto), nothing cached: GGUF conversion + empty compile cache",
                         r["wall_s"], r["call_s"], r["stats"]))
    hf = _transformers(prompt_file, new, 2)
    rows.append(("transformers: load and generate, new process", hf["wall_s"], hf["calls"][0],
                 "GGUF dequantised at every load"))
    rows.append(("transformers: warm call (second generate() in the same process)", None, hf["calls"][1],
                 f"{hf['prompt_tokens']} prompt tokens"))
    return rows


DECODE_SCRIPT = r"""
import json, sys, time
import structkv
model = structkv.load("gemma-3-270m")
prompt, new = open(sys.argv[1]).read(), int(sys.argv[2])
rows = {}
for name, compile in (("eager", False), ("decode compiled", "decode")):
    runs = []
    for _ in range(2):
        if compile == "decode":  # the decode step compiled, the prefill eager: what compile="auto" picks
            import structkv.util.compiling as c
            c.DECODE_TOKENS_COLD = c.DECODE_TOKENS_WARM = 1
            compile = "auto"
        t = time.perf_counter()
        out = structkv.generate(model, prompt, max_new_tokens=new, compile=compile, stop_at_eos=False)
        runs.append({"call_s": time.perf_counter() - t, "decode_s": out.stats["decode_s"]})
    rows[name] = runs
print(json.dumps(rows))
"""


def decode_compile(prompt_file: str, new: int) -> list[str]:
    """What compiling the decode step costs (first call, in a process with an empty or a warm
    inductor cache) and saves per token (second call), against eager in the same process."""
    lines = [f"## Compiling the decode step: cost and saving ({new} new tokens after the long prompt)", "",
             "| inductor cache | eager decode s (warm call) | compiled decode s (warm call) | ms saved per token | "
             "compile cost s (first compiled call minus a warm one) |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(DECODE_SCRIPT)
        f.flush()
        for state in ("empty", "warm"):
            _, out, _ = _run([sys.executable, f.name, prompt_file, str(new)],
                             {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
            rows = json.loads(out.strip().splitlines()[-1])
            eager, comp = rows["eager"][1]["decode_s"], rows["decode compiled"][1]["decode_s"]
            cost = rows["decode compiled"][0]["call_s"] - rows["decode compiled"][1]["call_s"]
            saved = (eager - comp) / (new - 1) * 1000
            lines.append(f"| {state} | {eager:.2f} | {comp:.2f} | {saved:.1f} | {cost:.1f} |")
    os.unlink(f.name)
    return lines + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    p.add_argument("--long-tokens", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=100, help="new tokens of the decode-compile measurement")
    p.add_argument("--only", choices=["all", "decode"], default="all",
                   help="decode: only the cost and saving of compiling the decode step")
    args = p.parse_args()
    import structkv
    from structkv.harness.eval.sources import needle_prompt

    model = structkv.load("gemma-3-270m")  # converts the GGUF once, so the rows below time what they say
    tmp = Path(tempfile.mkdtemp())
    (tmp / "short.txt").write_text(SHORT)
    needle = needle_prompt(model.tokenizer, args.long_tokens, 0.5)
    (tmp / "long.txt").write_text(model.tokenizer.decode(needle.prompt_ids))
    del model
    lines = [f"# Start-up: `structkv generate` vs transformers on Gemma 3 270M (GGUF), torch threads "
             f"{os.environ.get('OMP_NUM_THREADS', 'default')}, {os.cpu_count()} cores", "",
             "Command: `python research/experiments/startup.py" + (f" --out {args.out}" if args.out else "") + "`", ""]
    for name, file, new in [("short", tmp / "short.txt", 10), ("long", tmp / "long.txt", 64)][
            : 0 if args.only == "decode" else 2]:
        rows = case(name, str(file), new)
        title = (f"'{SHORT}', 10 new tokens" if name == "short"
                 else f"{args.long_tokens}-token needle prompt, 64 new tokens")
        lines += [f"## {title}", "", "| run | process s | generate call s | detail |", "|---|---|---|---|"]
        lines += [f"| {what} | {'-' if wall is None else f'{wall:.1f}'} | {call:.1f} | {detail} |"
                  for what, wall, call, detail in rows]
        lines.append("")
        print("\n".join(lines[-len(rows) - 4:]), flush=True)
    lines += decode_compile(str(tmp / "long.txt"), args.decode_tokens)
    print("\n".join(lines[-6:]), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
