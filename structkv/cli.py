"""Command line: `structkv demo` (the main job on the embedded default model) and `structkv generate`."""
from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    import torch

    import structkv
    from structkv.data import needle_prompt

    torch.set_num_threads(args.threads or torch.get_num_threads())
    t0 = time.perf_counter()
    model = structkv.load(args.model)
    print(f"loaded {args.model} ({model.config.model_type}, {model.config.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f} s")
    needle = needle_prompt(model.tokenizer, args.tokens, args.depth, seed=args.seed, root=args.data)
    t0 = time.perf_counter()
    out = structkv.generate(model, needle.prompt_ids, max_new_tokens=12, compile=not args.eager)
    first = time.perf_counter() - t0
    if not args.eager:  # the first call compiled prefill and decode; time a warm call too
        out = structkv.generate(model, needle.prompt_ids, max_new_tokens=12)
        print(f"first call (compiles prefill + decode): {first:.1f} s")
    found = needle.answer in out.text.replace(",", "")
    s = out.stats
    print(f"needle prompt: {len(needle.prompt_ids)} tokens, needle at depth {args.depth:.0%}")
    print(f"answer: {out.text.strip()!r} (expected {needle.answer}) -> {'FOUND' if found else 'MISSED'}")
    print(f"prefill {s['prefill_s']:.2f} s ({len(needle.prompt_ids) / s['prefill_s']:.0f} tok/s), decode {s['decode_tokens_per_s']:.1f} tok/s, KV cache {s['kv_cache_bytes'] / 2**20:.1f} MiB")

    full_prefill = s["prefill_s"]
    method = structkv.methods.get("structkv", r_struct=args.r_struct, kv_budget=args.kv_budget)
    for _ in range(1 if args.eager else 2):  # compiled: the first call compiles the layer blocks
        out = structkv.generate(model, needle.prompt_ids, max_new_tokens=12, compile=not args.eager, method=method)
    s = out.stats
    hit = needle.answer in out.text.replace(",", "")
    full_layers = model.config.full_attention_layers
    print(f"\nStructKV (R_struct={args.r_struct}, R_KV={args.kv_budget}): answer {out.text.strip()!r} -> "
          f"{'FOUND' if hit else 'MISSED'}")
    print(f"pivot layer {s['pivot_layer']} (T curve {s.get('t_curve')}), prefill fraction {s['prefill_fraction']:.2f} "
          f"(tokens per layer {s['tokens_per_layer']}), KV entries in full-attention layers "
          f"{[s['kv_entries_per_layer'][i] for i in full_layers]}, prefill {s['prefill_s']:.2f} s vs {full_prefill:.2f} s full "
          f"(scoring {s['scoring_s'] * 1000:.0f} ms, selection {s['selection_s'] * 1000:.0f} ms)")
    return 0 if found else 1


def _generate(args) -> int:
    import structkv

    model = structkv.load(args.model, dtype=args.dtype)
    out = structkv.generate(model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, compile=not args.eager, seed=args.seed)
    print(out.text)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="structkv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="needle-in-a-haystack answered by the embedded Gemma 3 270M, with timing")
    d.add_argument("--model", default="gemma-3-270m")
    d.add_argument("--tokens", type=int, default=2048)
    d.add_argument("--depth", type=float, default=0.5)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--data", default=None, help="data folder (default: $STRUCTKV_DATA or ../shared/data)")
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--eager", action="store_true", help="skip torch.compile")
    d.add_argument("--kv-budget", type=float, default=0.1)
    d.add_argument("--r-struct", type=float, default=0.2)
    d.set_defaults(fn=_demo)
    g = sub.add_parser("generate", help="continue a prompt")
    g.add_argument("prompt")
    g.add_argument("--model", default="gemma-3-270m")
    g.add_argument("--dtype", default=None)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--eager", action="store_true")
    g.set_defaults(fn=_generate)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, ConnectionError, ImportError) as e:
        print(f"structkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
