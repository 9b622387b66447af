"""`structkv bench`: prefill and decode speed, memory, KV bytes and overhead per method and length."""
from __future__ import annotations

import sys
from pathlib import Path

from .options import INT8_HELP, TP_HELP, _budget_options, _csv, _positive_int, _rank, _weights_option, _writable_folder


def _bench(args) -> int:
    import json

    import torch

    from structkv.harness import bench

    _writable_folder(args.out, "--out")
    if args.eval is not None and not (Path(args.eval) / "predictions.jsonl").exists():
        raise FileNotFoundError(f"--eval {args.eval} is not an eval result folder (no predictions.jsonl); "
                                "pass the --out folder of a `structkv eval` run")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    results = []
    for model in args.model:
        cfg = bench.BenchConfig(model=model, methods=args.methods, lengths=args.lengths, kv_budget=args.kv_budget,
                                struct_budget=args.struct_budget, pivot=args.pivot, new_tokens=args.new_tokens,
                                repeats=args.repeats, warmup=args.warmup, hf=not args.no_hf, dtype=args.dtype,
                                device=args.device, compile=not args.eager, seed=args.seed, int8_head=args.int8_head,
                                tp=args.tp, weights=args.weights, kv_dtype=args.kv_dtype)
        folder = out / model.replace("/", "_").replace(":", "_") if len(args.model) > 1 else out
        folder = folder / f"rank{_rank()}" if _rank() else folder  # under torchrun: each rank its own figures
        results.append(bench.run(cfg, folder))
        print(bench.markdown(results[-1]))
    try:
        plots = bench.plot(results, out, args.eval)
        print(f"plots: {', '.join(str(out / p) for p in plots)}")
    except ImportError as e:
        print(f"structkv: plots skipped ({e}); pip install matplotlib", file=sys.stderr)
    (out / "bench_all.json").write_text(json.dumps(results, indent=1))
    print(f"results in {out}/")
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="prefill / decode speed, memory and overhead per method and length")
    b.add_argument("--model", type=_csv(str), default=["gemma-3-270m"],
                   help="comma-separated: aliases, folders, .gguf, or random:<shape> (qwen2.5-0.5b, llama-3.2-1b, "
                        "llama-3.1-8b)")
    b.add_argument("--methods", type=_csv(str), default=["full", "snapkv", "fastkv", "structkv"])
    b.add_argument("--lengths", type=_csv(int), default=[4096])
    _budget_options(b, 0.1, 0.2)
    b.add_argument("--pivot", default=None,
                   help="pivot of every structkv* method: dynamic or a depth fraction such as 0.5 (default: each "
                        "method's own)")
    b.add_argument("--new-tokens", type=int, default=32)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    b.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    _weights_option(b)
    b.add_argument("--device", default="cpu")
    b.add_argument("--eval", default=None, help="an eval result folder: adds the accuracy Pareto plot")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench_results")
    b.add_argument("--threads", type=_positive_int, default=None)
    b.add_argument("--eager", action="store_true")
    b.add_argument("--int8-head", action="store_true", help=INT8_HELP)
    b.add_argument("--tp", type=_positive_int, default=None, help=TP_HELP)
    b.set_defaults(fn=_bench)
