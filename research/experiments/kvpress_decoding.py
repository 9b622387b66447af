"""kvpress's DecodingPress beside structkv's KV bound, on the fidelity measure of decode_bound.py.

Per LongBench record (the same records and prompt ids as `research/experiments/decode_bound.py`), SmolLM2
through transformers (from the GGUF structkv loads) generates the full cache's greedy continuation;
the same tokens are then teacher-forced, step by step, through kvpress's `PrefillDecodingPress`:
the prompt compressed to the low mark by a scorer press, then `DecodingPress` with the same scorer
compressing back to it every `every` tokens. The marks are `DecodeBound`'s defaults (low =
bound - every, every = bound // 8 up to 64), so both peak at the bound. Per step: KL(full ||
pressed) of the next-token distributions and top-1 agreement; per row the means (and over the
second half), the peak entries per layer and tokens/s. structkv's rows for the same records are in
decode_bound.py's output; `--ours` prints them beside these.

kvpress runs in its own venv (transformers < 5.3; benchmarks/kvpress_peer.py says how):

    /tmp/peers/bin/python research/experiments/kvpress_decoding.py --tasks gov_report,multi_news --first 1 --records 2 \\
        --continuation 512 --bounds 256,512 --presses streaming_llm,snapkv,knorm \\
        --out research/results/decode_bound/kvpress_dev2_smollm2.jsonl --ours research/results/decode_bound/dev2_smollm2.jsonl

Resumes: records already in `--out` are skipped; a table `.md` beside it is rewritten.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[2] / "benchmarks"))  # the maintained tool it builds on
from kvpress_peer import gguf_of, hf_model  # noqa: E402

PRESSES = ("streaming_llm", "snapkv", "knorm")


def scorer(name: str, every: int, compression_ratio: float = 0.0):
    """kvpress's scorer press `name`; SnapKV's observation window is the last `every - 1` tokens
    (its decoding scorer asserts the buffered tokens, `every`, outnumber the window)."""
    import kvpress

    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=compression_ratio, window_size=min(64, every - 1))
    cls = {"streaming_llm": kvpress.StreamingLLMPress, "knorm": kvpress.KnormPress}[name]
    return cls(compression_ratio=compression_ratio)


def marks(bound: int) -> tuple[int, int]:
    """(low, every) as `structkv.modules.DecodeBound` sets them for `bound` by default."""
    every = max(1, min(64, bound // 8))
    return bound - every, every


def step(model, token: int, position: int, cache) -> torch.Tensor:
    """One token at `position` through `cache`; log-probabilities of the next (V,) float32."""
    out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[position]]))
    return out.logits[0, -1].float().log_softmax(-1)


@torch.inference_mode()
def measure(model, ids: list[int], continuation: int, runs: list[tuple[int, str]]) -> list[dict]:
    """The full cache's continuation, then one teacher-forced pass per (bound, press)."""
    from kvpress import DecodingPress, PrefillDecodingPress
    from transformers import DynamicCache

    n = len(ids)
    cache = DynamicCache()
    t0 = time.perf_counter()
    ref = [model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1).logits[0, -1].float()
           .log_softmax(-1)]
    tokens = []
    for i in range(continuation - 1):
        tokens.append(int(ref[-1].argmax()))
        ref.append(step(model, tokens[-1], n + i, cache))
    rows = [{"bound": None, "rule": "full", "tokens_per_s": continuation / (time.perf_counter() - t0)}]
    for bound, name in runs:
        low, every = marks(bound)
        press = PrefillDecodingPress(prefilling_press=scorer(name, every, max(0.0, 1 - low / n)),
                                     decoding_press=DecodingPress(base_press=scorer(name, every),
                                                                  compression_interval=every,
                                                                  target_size=low))
        cache = DynamicCache()
        kl, agree, peak = [], [], 0
        t0 = time.perf_counter()
        with press(model):
            logp = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1).logits[0, -1] \
                .float().log_softmax(-1)
            for i in range(continuation):
                kl.append(float((ref[i].exp() * (ref[i] - logp)).sum()))
                agree.append(float(int(logp.argmax()) == int(ref[i].argmax())))
                peak = max(peak, max(layer.keys.shape[2] for layer in cache.layers))
                if i < continuation - 1:
                    logp = step(model, tokens[i], n + i, cache)
        half = continuation // 2
        rows.append({"bound": bound, "rule": f"kvpress:{name}", "kl": statistics.fmean(kl),
                     "kl_second_half": statistics.fmean(kl[half:]), "top1": statistics.fmean(agree),
                     "top1_second_half": statistics.fmean(agree[half:]), "peak_entries": peak,
                     "tokens_per_s": continuation / (time.perf_counter() - t0)})
    return rows


def table(lines: list[dict], ours: list[dict]) -> str:
    """Means over records per (bound, rule), kvpress's rows and structkv's for the same records."""
    records = {(x["task"], x["index"]) for x in lines}
    groups: dict = {}
    for source in (lines, [x for x in ours if (x["task"], x["index"]) in records]):
        for line in source:
            for row in line["rows"]:
                if row["rule"] != "full":
                    groups.setdefault((row["bound"], row["rule"]), []).append(row)
    out = ["| bound | rule | records | KL (nats) | KL 2nd half | top-1 | peak entries | tok/s |",
           "|---|---|---|---|---|---|---|---|"]
    for (bound, rule), rows in sorted(groups.items()):
        m = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
        peak = max(r.get("peak_entries") or max(r["kv_entries_max"]) for r in rows)
        out.append(f"| {bound} | {rule} | {len(rows)} | {m('kl'):.4f} | {m('kl_second_half'):.4f} | "
                   f"{m('top1'):.3f} | {peak} | {m('tokens_per_s'):.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", default="gov_report")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--records", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=512)
    p.add_argument("--bounds", default="256,512")
    p.add_argument("--presses", default=",".join(PRESSES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ours", type=Path, help="decode_bound.py's jsonl for the same records (rows beside these)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import structkv
    from structkv.harness.eval import longbench
    from structkv.util.files import write_text_atomic

    ours = structkv.load(args.model)
    model = hf_model(gguf_of(args.model), ours.config.eos_token_ids or ours.tokenizer.eos_ids)
    runs = [(int(b), name) for b in args.bounds.split(",") for name in args.presses.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(x) for x in args.out.read_text().splitlines()] if args.out.exists() else []
    seen = {(d["task"], d["index"]) for d in done}
    for task in args.tasks.split(","):
        for rec in longbench.load(task, ours.tokenizer, args.context, samples=args.records, first=args.first):
            if (task, rec["index"]) in seen:
                continue
            t0 = time.perf_counter()
            line = {"task": task, "index": rec["index"], "model": args.model, "prompt_tokens": len(rec["input_ids"]),
                    "continuation": args.continuation, "rows": measure(model, rec["input_ids"], args.continuation,
                                                                       runs)}
            with args.out.open("a") as f:  # one whole line per record
                f.write(json.dumps(line) + "\n")
            done.append(line)
            print(f"{task} #{rec['index']}: {time.perf_counter() - t0:.0f} s", flush=True)
    theirs = [json.loads(x) for x in args.ours.read_text().splitlines()] if args.ours and args.ours.exists() else []
    write_text_atomic(args.out.with_suffix(".md"), f"# kvpress DecodingPress and structkv's KV bound, {args.model}, "
                      f"{args.continuation}-token continuations, {args.tasks} from record {args.first}\n\n"
                      + table(done, theirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
