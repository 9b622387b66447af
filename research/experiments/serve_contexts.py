"""How many compressed contexts serve's context cache holds under one `--cache-bytes`, before and
after ask-time recall became the default: the bytes each cached state counts against the bound
(`structkv.serve.context_cache.state_bytes`: the hot set's buffers as allocated with serve's room,
its logits, and its archive when the archive is in RAM) for one many-questions document, per
configuration, and the contexts a bound holds (bound // bytes) as a ratio of the old default's.

Accuracy is not measured here: each configuration's is in research/results/README.md ("Ask-time
recall"; the same method and budgets), and int8 entries' effect in research/benchmarks_log.md.

    python research/experiments/serve_contexts.py --model gemma-3-270m --length 4096 --cache-bytes 1GiB
"""
from __future__ import annotations

import argparse
import tempfile

import structkv
from structkv import methods
from structkv.harness.eval.runner import EvalConfig, build_samples
from structkv.serve.context_cache import archive_bytes, hot_bytes, state_bytes

# (label, method (None: the model kind's default, `methods.context_default`), R_KV, archive kind
# or None, archive on disk, KV entries dtype or None)
CONFIGS = [
    ("old default: structkv_agnostic_union @ 0.2", "structkv_agnostic_union", None, None, False, None),
    ("default: {name} @ {kv} + int4 archive in RAM", None, None, "int4", False, None),
    ("default, --archive-dir", None, None, "int4", True, None),
    ("default, --archive-dir, --kv-dtype int8", None, None, "int4", True, "int8"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--room", type=int, default=512, help="serve's --room")
    p.add_argument("--cache-bytes", default="1GiB")
    args = p.parse_args()
    from structkv.cli import _bytes

    bound = _bytes(args.cache_bytes)
    models = {}
    rows = []
    for label, name, kv, archive, disk, kv_dtype in CONFIGS:
        if kv_dtype not in models:
            models[kv_dtype] = structkv.load(args.model, kv_dtype=kv_dtype)
        model = models[kv_dtype]
        if name is None:
            name, kv = methods.context_default(model.config)
            label = label.format(name=name, kv=kv)
        cfg = EvalConfig("ruler", model=args.model, tasks=["niah_many"], samples=1, lengths=[args.length], seed=42,
                         question_after=True, chat=args.chat)
        context = build_samples(cfg, model.tokenizer)[0]["input_ids"]
        with tempfile.TemporaryDirectory() as folder:
            state = structkv.prefill(model, context, methods.build(name, kv=kv), room=args.room, archive=archive,
                                     archive_dir=folder if disk else None)
            rows.append((label, hot_bytes(state), archive_bytes(state), disk, state_bytes(state)))
    base = bound // rows[0][4]
    print(f"{args.model}, a {len(context)}-token many-questions document, room {args.room}, "
          f"--cache-bytes {args.cache_bytes}\n")
    print("| configuration | hot set MiB | archive MiB | archive | counted MiB | contexts held | vs old default |")
    print("|---|---|---|---|---|---|---|")
    for label, hot, arch, disk, counted in rows:
        held = bound // counted
        print(f"| {label} | {hot / 2**20:.2f} | {arch / 2**20:.2f} | {'disk' if disk else 'RAM'} | "
              f"{counted / 2**20:.2f} | {held} | {held / base:.2f}x |")


if __name__ == "__main__":
    main()
