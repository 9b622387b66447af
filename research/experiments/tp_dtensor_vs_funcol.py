"""Why functional collectives and not DTensor for structkv's tensor parallelism: both on the same
weights, 2 gloo ranks on this CPU, eager, side by side in one run.

- funcol: what `structkv.load(..., tp=2)` builds (local heads, `RowParallelLinear` all-reduces).
- DTensor: the whole model on each rank, then torch's `parallelize_module` with ColwiseParallel on
  q/k/v/gate/up and RowwiseParallel on o_proj/down_proj (the torchtitan recipe), attention told
  its local head counts.
Prints prefill seconds (one prompt), decode tokens/s (full cache) and the largest logit difference
between the two (and to one process).

    python research/experiments/tp_dtensor_vs_funcol.py --shape qwen2.5-0.5b --tokens 1024
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta


def _timed(fn, repeats):
    out, times = None, []
    for _ in range(repeats + 1):  # first call warms up
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times[1:])


def _worker(rank, world, store, args, results):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import structkv
    from structkv.distributed import TensorParallel, local_config
    from structkv.distributed.sharding import shard_slice
    from structkv.models.loading import assemble
    from structkv.models.shapes import random_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    tp = TensorParallel(dist.group.WORLD, rank, world)
    whole = random_model(args.shape)  # same seed: the same weights on every rank
    cfg = whole.config
    sd = whole.state_dict()

    def shard(name, t):
        spec = shard_slice(name, tuple(t.shape), world, rank)
        if spec is None:
            return t
        dim, a, b = spec
        return t.narrow(dim, a, b - a).clone()

    funcol = assemble(cfg, {k: shard(k, v) for k, v in sd.items()}, dtype=torch.float32, device=torch.device("cpu"),
                   source="random", tp=tp)
    dtensor = random_model(args.shape)
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i, block in enumerate(dtensor.model.layers):
        block.self_attn.num_heads //= world
        block.self_attn.num_kv_heads //= world
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(dtensor, mesh, plan)
    dtensor.config = local_config(cfg, world)  # the KV cache holds the local heads

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (1, args.tokens), generator=gen)
    pos = torch.arange(args.tokens)[None]
    row = {}
    with torch.inference_mode():
        ref = whole(ids, pos)[:, -1]
        for label, model in (("dtensor", dtensor), ("funcol", funcol)):
            logits, prefill_s = _timed(lambda m=model: m(ids, pos)[:, -1], args.repeats)
            out, decode_s = _timed(lambda m=model: structkv.generate(
                m, ids[0].tolist(), max_new_tokens=args.new_tokens, stop_at_eos=False, compile=False), args.repeats)
            row[label] = {"prefill_s": prefill_s, "decode_tokens_per_s": (args.new_tokens - 1) / out.stats["decode_s"],
                          "max_logit_diff_vs_one_process": (logits - ref).abs().max().item(), "tokens": out.token_ids}
    if rank == 0:
        results.update(row)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), args, results), nprocs=2, join=True)
        r = dict(results)
    f, d = r["funcol"], r["dtensor"]
    print(f"TP=2 on gloo, {args.shape} (random weights, fp32), {args.tokens}-token prompt, eager, median of "
          f"{args.repeats}\n")
    print("| | functional collectives (structkv) | DTensor parallelize_module | DTensor / funcol |")
    print("|---|---|---|---|")
    print(f"| prefill s | {f['prefill_s']:.3f} | {d['prefill_s']:.3f} | {d['prefill_s'] / f['prefill_s']:.2f}x |")
    print(f"| decode tok/s | {f['decode_tokens_per_s']:.2f} | {d['decode_tokens_per_s']:.2f} | "
          f"{d['decode_tokens_per_s'] / f['decode_tokens_per_s']:.2f}x |")
    print(f"| max logit diff vs one process | {f['max_logit_diff_vs_one_process']:.1e} | "
          f"{d['max_logit_diff_vs_one_process']:.1e} | |")
    print(f"\nsame greedy tokens: {f['tokens'] == d['tokens']}")


if __name__ == "__main__":
    main()
