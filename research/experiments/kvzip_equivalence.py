"""structkv's `kvzip_kvpress` against kvpress's own KVzipPress, entry by entry, on one eval folder's prompts.

Issue 46 asked that the two agree within noise or that the reason they differ be named. This
compresses each context of a structkv eval folder (made with --question-after-compression) both
ways on the same GGUF weights (structkv's decoder; transformers' model under kvpress's press) and
compares per layer and KV head: the reconstruction scores (largest absolute difference) and the
kept entries (Jaccard overlap of the kept sets; KVzipPress masks what it evicts, structkv drops
it). Runs in the peers venv (kvpress pins transformers < 5.3; see kvpress_peer.py).

    /tmp/peers/bin/python research/experiments/kvzip_equivalence.py research/results/many_dev_smollm2_2k --contexts 4 \\
        --kv-budget 0.1,0.2 --out research/results/kvzip_equivalence/smollm2_2k.md
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[2] / "benchmarks"))  # the maintained tool it builds on
from kvpress_peer import gguf_of, hf_model  # noqa: E402

import structkv
from structkv import methods
from structkv.harness.eval.runner import EvalConfig, build_samples
from structkv.methods.kvzip import ReconstructionRetention
from structkv.util.files import write_text_atomic


def kvpress_side(model, context: list[int], kv_budget: float):
    """KVzipPress's scores (L, Hkv, n) and kept masks (L, Hkv, n) for one context."""
    from kvpress import KVzipPress
    from transformers import DynamicCache

    press, seen = KVzipPress(compression_ratio=1.0 - kv_budget), {}
    post = press.compress_post

    def capture(model):
        seen["scores"] = press.score_val[:, 0].float().clone()  # (L, Hkv, n)
        post(model)
    press.compress_post = capture
    with torch.inference_mode(), press(model):
        model.model(input_ids=torch.tensor([context]), past_key_values=DynamicCache())
    kept = torch.ones_like(seen["scores"], dtype=torch.bool)
    for i, layer in enumerate(model.model.layers):
        _, heads, cols = layer.self_attn.masked_key_indices
        kept[i, heads, cols] = False
        layer.self_attn.masked_key_indices = None  # the next context starts unmasked
    return seen["scores"], kept


def structkv_side(ours, context: list[int], kv_budget: float):
    """structkv's `kvzip_kvpress` scores (L, Hkv, n) and kept masks (L, Hkv, n)."""
    seen, score = {}, ReconstructionRetention._score

    def capture(self, model, tokens):
        out = score(self, model, tokens)
        seen["scores"] = torch.stack([out[0][i][0].float() for i in sorted(out[0])])
        return out
    ReconstructionRetention._score = capture
    try:
        state = structkv.prefill(ours, context, methods.get("kvzip_kvpress", kv_budget=kv_budget), room=8)
    finally:
        ReconstructionRetention._score = score
    n = len(context)
    kept = torch.zeros_like(seen["scores"], dtype=torch.bool)
    for i, layer in enumerate(state.cache.layers):
        pos = layer.pos[0, :, :int(layer.cursor)]  # (Hkv, used)
        for h in range(pos.shape[0]):
            p = pos[h][(pos[h] >= 0) & (pos[h] < n)]
            kept[i, h, p] = True
    return seen["scores"], kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a structkv eval folder of a chat model (kvpress runs Llama-family)")
    ap.add_argument("--contexts", type=int, default=4, help="distinct contexts compared")
    ap.add_argument("--kv-budget", default="0.1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="the table (markdown)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    stored = json.loads((a.source / "config.json").read_text())["config"]
    cfg = EvalConfig(**{k: v for k, v in stored.items() if k in EvalConfig.__dataclass_fields__})
    ours = structkv.load(cfg.model)
    model = hf_model(gguf_of(cfg.model), ours.config.eos_token_ids or ours.tokenizer.eos_ids)
    contexts, seen = [], set()
    for sample in build_samples(cfg, ours.tokenizer):
        if tuple(sample["input_ids"]) not in seen and len(contexts) < a.contexts:
            seen.add(tuple(sample["input_ids"]))
            contexts.append(sample["input_ids"])
    rows = ["| context | tokens | R_KV | max abs score difference | kept entries kvpress / structkv | "
            "Jaccard of kept sets (mean over layers, worst layer) |", "|---|---|---|---|---|---|"]
    for c, context in enumerate(contexts):
        for budget in map(float, a.kv_budget.split(",")):
            ks, kk = kvpress_side(model, context, budget)
            us, uk = structkv_side(ours, context, budget)
            diff = float((ks[..., 4:] - us[..., 4:]).abs().max())  # the sinks: a constant above every score
            jac = [float((kk[i] & uk[i]).sum() / (kk[i] | uk[i]).sum()) for i in range(kk.shape[0])]
            rows.append(f"| {c} | {len(context)} | {budget:g} | {diff:.1e} | {int(kk.sum())} / {int(uk.sum())} | "
                        f"{statistics.fmean(jac):.4f}, {min(jac):.4f} |")
            print(rows[-1], flush=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    write_text_atomic(a.out, f"# KVzip: structkv's `kvzip_kvpress` vs kvpress's KVzipPress, {cfg.model}\n\n"
                      f"`/tmp/peers/bin/python research/experiments/kvzip_equivalence.py {command}`\n\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
