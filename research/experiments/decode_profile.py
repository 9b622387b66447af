"""Where a compiled decode step's time goes: torch.profiler over `structkv.generate`'s decode.

Loads a model, generates twice (compile and warm), then profiles one more generation of
`--new-tokens` after the same `--length`-token prompt and prints the ops by self time. The prompt's
own ops (aten::mm, flash attention, structkv::causal_attention) are in the table too; the decode
rows are the ones called once per token (or once per layer per token). `--kernel-profile` also
times each inductor kernel by name (inductor's `cpp.enable_kernel_profile`; recompiles).

    python research/experiments/decode_profile.py --model smollm2 --weights int4 --kv-dtype bf16 --length 1024 --threads 2
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--kernel-profile", action="store_true")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import structkv
    from structkv.harness.bench import prompt_ids

    if args.kernel_profile:
        import torch._inductor.config as inductor

        inductor.cpp.enable_kernel_profile = True
        inductor.force_disable_caches = True
    torch.set_num_threads(args.threads)
    model = structkv.load(args.model, weights=args.weights, kv_dtype=args.kv_dtype)
    ids = prompt_ids(model, args.length, 0)

    def run():
        return structkv.generate(model, ids, max_new_tokens=args.new_tokens, stop_at_eos=False, compile=True,
                                 timing=True)

    for _ in range(2):
        speed = run().stats["decode_tokens_per_s"]
    print(f"decode without the profiler: {speed:.1f} tokens/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=90))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
