"""structkv.hf on exactly the prompts of a structkv eval folder: the methods on transformers' model.

The side by side of issue 47: the same model (transformers' own, from the GGUF structkv loads),
the same token ids (the folder's prompts rebuilt from its config.json), the context compressed
once by `structkv.hf.compress`, the question appended uncompressed by `structkv.hf.generate`
(greedy, stopping at EOS), scored with structkv's metric. The folder it writes pairs prompt by
prompt with the source (structkv's own decoder) and with benchmarks/kvpress_peer.py's (kvpress's
presses on transformers): labels `hf:<method>@<R_KV>`, with the prefill seconds, the share of
token-layers computed and the K+V bytes kept.

    python benchmarks/hf_peer.py docs/results/ruler_2k_question_after_smollm2 --methods snapkv,keydiff,structkv \\
        --kv-budget 0.1,0.2
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from kvpress_peer import gguf_of, hf_model


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
    import structkv
    from structkv.harness.eval.runner import EvalConfig, _read_predictions, build_samples, sample_key, score

    source = Path(args.source)
    stored = json.loads((source / "config.json").read_text())["config"]
    if not stored.get("question_after"):
        raise SystemExit(f"{source} was not made with --question-after-compression: make the folder in that mode")
    cfg = EvalConfig(**{k: v for k, v in stored.items() if k in EvalConfig.__dataclass_fields__})
    cfg.samples = args.samples or cfg.samples
    ours = structkv.load(cfg.model)
    model = hf_model(gguf_of(cfg.model), ours.config.eos_token_ids or ours.tokenizer.eos_ids)
    out = Path(args.out or f"{source}_hf")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "config.json", out / "config.json")  # the same identity settings: the folders pair
    done = _read_predictions(out / "predictions.jsonl") if (out / "predictions.jsonl").exists() else {}
    runs = [(m, float(b)) for m in args.methods.split(",") for b in args.kv_budget.split(",")]
    with (out / "predictions.jsonl").open("a") as sink:
        for sample in build_samples(cfg, ours.tokenizer):
            for name, budget in runs:
                label = f"hf:{name}@{budget:g}"
                key = sample_key(label, sample)
                if key in done:
                    continue
                cap = sample["max_new_tokens"] if cfg.max_new_tokens is None else min(cfg.max_new_tokens,
                                                                                     sample["max_new_tokens"])
                ids, stats, kept = answer(model, name, budget, sample["input_ids"], sample["question_ids"], cap)
                said = ours.tokenizer.decode(ids)
                record = {"key": key, "label": label, "method": f"hf:{name}", "kv_budget": budget,
                          "task": sample["task"], "index": sample["index"], "length_budget": sample["length_budget"],
                          "prompt_tokens": len(sample["input_ids"]) + len(sample["question_ids"]), "prediction": said,
                          "outputs": sample["outputs"], "score": score(sample, said), "kv_bytes_kept": kept,
                          "prefill_s": stats["prefill_s"], "prefill_fraction": stats["prefill_fraction"]}
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                print(f"{label} {sample['task']} #{sample['index']}: {record['score']:.0f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
