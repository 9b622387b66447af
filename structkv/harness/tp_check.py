"""Tensor parallelism against one process: spawn `world` ranks on gloo (CPU), load each model folder
whole and as a TP shard in every rank, and compare, for `full` and every registered method:
logits, greedy tokens, pivots, tokens computed per layer, kept prompt columns and each rank's
cache entries (its heads of the single-process cache), and a KV bound while generating (every
rule). Used by tests/test_tensor_parallel.py and by benchmarks/gpu_check.sh
(`python -m structkv.harness.tp_check FOLDER ...`).

Every rank records what differs; rank 0 writes the union as JSON. A rank that raises ends the
spawn with its traceback; collectives time out (`timeout_s`), so a lost rank never hangs the run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

ATOL = 1e-5


def prompts(vocab: int) -> list[list[int]]:
    """Two rows of different lengths (the shorter is left-padded), fixed seed."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (53, 38)]


def compare_folder(folder: str, world: int, compile_decode: bool = False) -> list[str]:
    """What differs between `folder` loaded whole and as this rank's TP shard (empty: nothing)."""
    import structkv
    from structkv import methods
    from structkv.runtime.compress import compress
    from structkv.text.prompts import encode_batch

    whole, shard = structkv.load(folder), structkv.load(folder, tp=world)
    rows = prompts(whole.config.vocab_size)
    tokens, positions, _ = encode_batch(whole, rows)
    bad = []
    diff = (whole(tokens, positions) - shard(tokens, positions)).abs().max().item()
    if diff > ATOL:
        bad.append(f"{folder}: full-sequence logits differ by {diff:.2e}")
    for name in methods.names():
        method = methods.build(name, kv=0.3, struct=0.5)
        a, b = (compress(m, tokens, positions, method, room=16) for m in (whole, shard))
        bad += _states_differ(f"{folder} {name}", a, b, shard.tp)
        kw = dict(method=method, max_new_tokens=6, stop_at_eos=False, compile=False)
        ta = structkv.generate(whole, rows, **kw).token_ids
        tb = structkv.generate(shard, rows, **kw).token_ids
        if ta != tb:
            bad.append(f"{folder} {name}: greedy tokens differ: {ta} vs {tb}")
    bad += _bounded_decode(whole, shard, rows, folder)
    if compile_decode:
        bad += _compiled_decode(whole, shard, rows, folder)
        bad += _quantized_kv(whole, shard, rows, tokens, positions, folder)
    return bad


def _bounded_decode(whole, shard, rows, folder) -> list[str]:
    """A KV bound while generating, every rule, after a StructKV prefill (the centrality rule sums
    its heads over the ranks): the same tokens and peak entries as one process."""
    import structkv
    from structkv import methods
    from structkv.modules import DecodeBound
    from structkv.modules.decode_rules import RULES

    bad = []
    for rule in RULES:
        kw = dict(method=methods.get("structkv"), max_new_tokens=40, stop_at_eos=False, compile=False,
                  max_kv_tokens=DecodeBound(24, rule))
        a, b = structkv.generate(whole, rows, **kw), structkv.generate(shard, rows, **kw)
        if a.token_ids != b.token_ids or a.stats["kv_entries_max"] != b.stats["kv_entries_max"]:
            bad.append(f"{folder} bound rule {rule}: {a.token_ids} / {a.stats['kv_entries_max']} vs "
                       f"{b.token_ids} / {b.stats['kv_entries_max']}")
    return bad


def _quantized_kv(whole, shard, rows, tokens, positions, folder) -> list[str]:
    """int8 / int4 KV entries under TP: each rank holds its heads' entries of the single-process
    cache (scales per token and head: nothing crosses ranks; a code may differ by one step where
    the sharded projection's last bit lands a value on the other side of a rounding boundary),
    and decodes the same tokens."""
    import structkv
    from structkv import methods
    from structkv.runtime.compress import compress

    bad = []
    for kv_dtype in ("int8", "int4"):
        whole.kv_dtype = shard.kv_dtype = kv_dtype
        try:
            for name in ("full", "structkv"):
                method = methods.build(name, kv=0.3, struct=0.5)
                a, b = (compress(m, tokens, positions, method, room=16) for m in (whole, shard))
                for i, (la, lb) in enumerate(zip(a.cache.layers, b.cache.layers)):
                    heads = shard.tp.heads(lb.pos.shape[1])
                    step = max(float(la.k_scale.max()), float(la.v_scale.max()))
                    far = max(float((x[:, heads] - y).abs().max()) for x, y in zip(la.read(), lb.read()))
                    if not torch.equal(la.pos[:, heads], lb.pos) or far > 1.01 * step + ATOL:
                        bad.append(f"{folder} {name} {kv_dtype}: layer {i} quantized entries differ on rank "
                                   f"{shard.tp.rank} by {far:.2e} (one step: {step:.2e})")
                kw = dict(method=method, max_new_tokens=6, stop_at_eos=False, compile=False)
                ta, tb = (structkv.generate(m, rows, **kw).token_ids for m in (whole, shard))
                if ta != tb:
                    bad.append(f"{folder} {name} {kv_dtype}: greedy tokens differ under TP: {ta} vs {tb}")
        finally:
            whole.kv_dtype = shard.kv_dtype = None
    return bad


def _states_differ(label, a, b, tp) -> list[str]:
    bad = []
    for field in ("pivot_layer", "tokens_per_layer"):
        if a.stats[field] != b.stats[field]:
            bad.append(f"{label}: {field} {a.stats[field]} vs {b.stats[field]}")
    if a.kept_columns is not None and not torch.equal(a.kept_columns, b.kept_columns):
        bad.append(f"{label}: kept prompt columns differ")
    for i, (la, lb) in enumerate(zip(a.cache.layers, b.cache.layers)):
        mine = la.pos[:, tp.heads(lb.pos.shape[1])]  # this rank's heads of the whole cache
        if not torch.equal(mine, lb.pos):
            bad.append(f"{label}: layer {i} cache positions differ on rank {tp.rank}")
    diff = (a.logits - b.logits).abs().max().item()
    if diff > ATOL:
        bad.append(f"{label}: logits after compression differ by {diff:.2e}")
    if b.stats["kv_bytes_all_ranks"] != a.stats.kv_bytes:
        bad.append(f"{label}: kept bytes over all ranks {b.stats['kv_bytes_all_ranks']} vs {a.stats.kv_bytes}")
    return bad


def _compiled_decode(whole, shard, rows, folder) -> list[str]:
    """The decode step compiled with the all-reduces inside its graph: same tokens, one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import structkv

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    kw = dict(max_new_tokens=8, stop_at_eos=False)
    ta = structkv.generate(whole, rows, compile=False, **kw).token_ids
    tb = structkv.generate(shard, rows, compile=counter, **kw).token_ids
    bad = [] if ta == tb else [f"{folder} compiled decode under TP: tokens differ: {ta} vs {tb}"]
    if counter.frame_count != 2:  # one prefill graph + one decode graph, as in one process
        bad.append(f"{folder} compiled under TP: {counter.frame_count} graphs, expected 2")
    return bad


def _worker(rank: int, world: int, store: str, folders: list[str], out: str, timeout_s: float, fail_rank: int,
            compile_decode: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        if rank == fail_rank:  # dies without a word: the others must not wait for it forever
            os._exit(0)
        bad = [msg for i, folder in enumerate(folders)
               for msg in compare_folder(folder, world, compile_decode and i == 0)]
        gathered = [None] * world
        dist.all_gather_object(gathered, bad)
        if rank == 0:
            Path(out).write_text(json.dumps(sorted({m for part in gathered for m in part})))
    finally:
        dist.destroy_process_group()


def run(folders, world: int = 2, timeout_s: float = 120, fail_rank: int = -1, compile_decode: bool = False):
    """Spawn `world` gloo ranks over `folders`; returns the differences (empty: TP equals one
    process). Raises torch.multiprocessing.ProcessRaisedException when a rank fails."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(world, store, [str(f) for f in folders], out, timeout_s, fail_rank, compile_decode),
                 nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="HF model folders (tiny ones: every method runs on each)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--compile", action="store_true", help="also the compiled decode under TP (first folder)")
    args = p.parse_args(argv)
    bad = run(args.folders, args.world, args.timeout, compile_decode=args.compile)
    print("\n".join(bad) if bad else f"TP={args.world} equals one process on {len(args.folders)} model(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
