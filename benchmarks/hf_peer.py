"""structkv.hf on exactly the prompts of a structkv eval folder: the methods on transformers' model.

The side by side of issue 47: the same model (transformers' own, from the GGUF structkv loads),
the same token ids (the folder's prompts rebuilt from its config.json), the context compressed
once by `structkv.hf.compress`, the question appended uncompressed by `structkv.hf.generate`
(greedy, stopping at EOS), scored with structkv's metric. The folder it writes pairs prompt by
prompt with the source (structkv's own decoder) and with benchmarks/kvpress_peer.py's (kvpress's
presses on transformers): labels `hf:<method>@<R_KV>`, with the prefill seconds, the share of
token-layers computed and the K+V bytes kept.

    python benchmarks/hf_peer.py research/results/ruler_2k_question_after_smollm2 --methods snapkv,keydiff,structkv \\
        --kv-budget 0.1,0.2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from kvpress_peer import gguf_of, hf_model, run_peer


@torch.inference_mode()
def answer(model, method: str, budget: float, context: list[int], question: list[int], max_new_tokens: int):
    from structkv import hf

    state = hf.compress(model, None, context, method, kv_budget=budget)
    out = hf.generate(model, None, question, state=state, max_new_tokens=max_new_tokens)
    kept = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in state.cache.layers)
    return out["token_ids"], state.stats, kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a structkv eval folder made with --question-after-compression")
    ap.add_argument("--methods", default="snapkv,keydiff,structkv")
    ap.add_argument("--kv-budget", default="0.1,0.2")
    ap.add_argument("--out", help="default: SOURCE_hf")
    ap.add_argument("--samples", type=int, help="per task, fewer than the source's (a partial run; resumable)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    def setup(ours, cfg):
        model = hf_model(gguf_of(cfg.model), ours.config.eos_token_ids or ours.tokenizer.eos_ids)

        def one(name, budget, sample, cap):
            ids, stats, kept = answer(model, name, budget, sample["input_ids"], sample["question_ids"], cap)
            return ours.tokenizer.decode(ids), {"kv_bytes_kept": kept, "prefill_s": stats["prefill_s"],
                                                "prefill_fraction": stats["prefill_fraction"]}
        return one

    runs = [(m, float(b)) for m in args.methods.split(",") for b in args.kv_budget.split(",")]
    run_peer(Path(args.source), args.out, args.samples, "hf", runs, setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
