"""Which methods keep the answer in the cache when the question is not in what is compressed.

Query-agnostic RULER prompts (the context only, `--question-after-compression`'s split): for each
sample, the answer's tokens are found in the context, every method compresses the context in one
shared prefill, and the script reports, per method and full-attention layer, the share of answer
tokens whose entries the cache kept (and the share that reached the last layer's computation).
No decoding: minutes instead of an eval's hour, to choose query-free signals on a development
split before running the eval on it and on the confirmation split.

    python research/experiments/answer_retention.py --seed 7 --samples 3 --methods snapkv,kvzip,structkv \
        --kv-budget 0.1 --tasks niah_single_1,niah_single_2,niah_multikey_1
"""
from __future__ import annotations

import argparse
import ast
import statistics
import sys

import torch

import structkv
from structkv import methods as registry
from structkv.harness.eval.runner import EvalConfig, build_samples
from structkv.text.prompts import encode_batch


def answer_columns(tokenizer, ids: list[int], answers: list[str]) -> list[int]:
    """Context columns holding an answer's tokens (each answer searched with and without a space)."""
    out = []
    for answer in answers:
        for variant in (f" {answer}", answer):
            pattern = tokenizer.encode(variant, add_bos=False)
            hits = [i for i in range(len(ids) - len(pattern) + 1) if ids[i:i + len(pattern)] == pattern]
            if hits:
                out += [c for i in hits for c in range(i, i + len(pattern))]
                break
    return sorted(set(out))


def sentence_columns(tokenizer, ids: list[int], answer_cols: list[int]) -> list[int]:
    """The needle sentences: from each answer run back to the previous sentence end (what the
    question's key must match), the answer included."""
    out = set(answer_cols)
    for c in answer_cols:
        j = c - 1
        while j >= 0 and j not in out and not tokenizer.decode(ids[j:j + 1]).rstrip(" ").endswith((".", "\n")):
            out.add(j)
            j -= 1
    return sorted(out)


@torch.inference_mode()
def retention(model, sample: dict, methods: list, answer: list[int], sentence: list[int]) -> list[dict]:
    """Per method: {layer: share of answer columns in its cache}, the share of the needle sentences'
    columns kept at the last full layer, and the share of answer columns reaching the end."""
    tokens, positions, _ = encode_batch(model, [sample["input_ids"]])
    states = structkv.compress_shared(model, tokens, positions, methods, room=0)
    wanted, whole = torch.tensor(answer), torch.tensor(sentence)
    out = []
    for state in states:
        row = {}
        for layer in model.config.full_attention_layers:
            pos = state.cache.layers[layer].pos[0]  # (Hkv, C)
            row[layer] = float(torch.isin(wanted, pos).float().mean())  # kept by some head
            row["sentence"] = float(torch.isin(whole, pos).float().mean())  # the last full layer's
        row["reached"] = float(torch.isin(wanted, state.kept_columns[0]).float().mean())
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--methods", default="snapkv,kvzip,structkv")
    ap.add_argument("--kv-budget", default="0.1")
    ap.add_argument("--struct-budget", default="0.2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7, help="7: the development split; 42: the confirmation split")
    ap.add_argument("--option", action="append", default=[],
                    help="method:key=value (a Python literal), e.g. structkv:probe='Facts:'; repeatable")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = structkv.load(args.model)
    options: dict[str, dict] = {}
    for item in args.option:
        label, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        options.setdefault(label, {})[key] = ast.literal_eval(value)
    labels = args.methods.split(",")
    methods = [registry.build(label.split("#")[0], kv=args.kv_budget, struct=args.struct_budget,
                              **options.get(label, {})) for label in labels]
    cfg = EvalConfig(benchmark="ruler", methods=["full"], lengths=[args.length], tasks=args.tasks.split(","),
                     samples=args.samples, seed=args.seed, question_after=True)
    rows = {label: [] for label in labels}
    for sample in build_samples(cfg, model.tokenizer):
        cols = answer_columns(model.tokenizer, sample["input_ids"], sample["outputs"])
        if not cols:
            print(f"skip {sample['task']} #{sample['index']}: answer not found in the context", file=sys.stderr)
            continue
        sentence = sentence_columns(model.tokenizer, sample["input_ids"], cols)
        for label, row in zip(labels, retention(model, sample, methods, cols, sentence)):
            rows[label].append(row)
        print(f"{sample['task']} #{sample['index']}: " + ", ".join(
            f"{label} {rows[label][-1][model.config.full_attention_layers[-1]]:.2f}" for label in labels),
            file=sys.stderr)
    layers = model.config.full_attention_layers
    print(f"| method | {' | '.join(f'L{l} answer kept' for l in layers)} | L{layers[-1]} needle sentence kept "
          "| answer reached the end | prompts |")
    print("|---|" + "---|" * (len(layers) + 3))
    for label in labels:
        r = rows[label]
        cells = [f"{statistics.mean(x[l] for x in r):.2f}" for l in layers]
        print(f"| {label} | {' | '.join(cells)} | {statistics.mean(x['sentence'] for x in r):.2f} | "
              f"{statistics.mean(x['reached'] for x in r):.2f} | {len(r)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
