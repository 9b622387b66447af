"""GPU check of the custom ops: Triton kernels vs the references, correctness and speed.

Needs CUDA and Triton. Prints a markdown table; exits non-zero on a mismatch.
    python benchmarks/gpu_ops.py [--lengths 8192,32768,65536,131072]
"""
from __future__ import annotations

import argparse
import sys

import torch

from structkv.ops import compact_kv_reference, window_scores, window_scores_naive
from structkv.ops.triton_kernels import compact_kv_triton

W, HQ, HKV, D = 32, 32, 8, 128
SWEEP = [  # Hq, Hkv, D, sliding window, softcap: GQA 1 / 4 / 8, Llama / Qwen / Gemma heads
    (8, 8, 64, 0, 0.0), (32, 8, 128, 0, 0.0), (8, 1, 256, 512, 0.0), (16, 2, 128, 0, 50.0), (32, 4, 256, 128, 30.0),
]


def cuda_time(fn, repeats=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def correctness_sweep() -> bool:
    """Every kernel against its reference at the heads above, bf16 and fp16, one and many key
    splits; the quantized decode with int8 and int4 entries. Prints one line per case."""
    from structkv.ops.kv_quant import quantize_kv, quantized_decode_attention_reference
    from structkv.ops.triton_kernels import quantized_decode_attention_triton, window_scores_triton

    ok = True
    for hq, hkv, d, window, softcap in SWEEP:
        for dtype in (torch.bfloat16, torch.float16):
            g = torch.Generator(device="cuda").manual_seed(d + hq)
            q = torch.randn(2, hq, W, d, device="cuda", dtype=dtype, generator=g)
            k = torch.randn(2, hkv, 3000, d, device="cuda", dtype=dtype, generator=g)
            k_pos = torch.arange(3000, device="cuda").expand(2, -1).contiguous()
            q_pos = k_pos[:, -W:].contiguous()
            ref_sal, ref_ent = window_scores_naive(q, k, q_pos, k_pos, d**-0.5, window, softcap)
            for splits in (1, None, 7):
                sal, ent = window_scores_triton(q, k, q_pos, k_pos, d**-0.5, window, softcap, splits=splits)
                err = max((sal - ref_sal).abs().max().item(), (ent - ref_ent).abs().max().item() / 10)
                ok &= err < 1e-4
                print(f"window_scores Hq={hq} Hkv={hkv} D={d} window={window} softcap={softcap} {dtype} "
                      f"splits={splits}: max err {err:.1e}", flush=True)
            for kind in ("int8", "int4"):
                qd = torch.randn(2, hq, 1, d, device="cuda", dtype=dtype, generator=g)
                kq, vq = (list(quantize_kv(torch.randn(2, hkv, 3000, d, device="cuda", generator=g), kind))
                          for _ in range(2))
                mask = torch.rand(2, 1, 1, 3000, device="cuda", generator=g) > 0.3
                want = quantized_decode_attention_reference(qd, kq, vq, mask, d**-0.5, kind)
                for splits in (1, None):
                    got = quantized_decode_attention_triton(qd, kq, vq, mask, d**-0.5, kind, splits=splits)
                    err = (got.float() - want.float()).abs().max().item()
                    ok &= err < 2e-2
                    print(f"quantized_decode {kind} Hq={hq} Hkv={hkv} D={d} {dtype} splits={splits}: max err {err:.1e}",
                          flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_ops.py needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = correctness_sweep()
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        for dtype in (torch.bfloat16, torch.float16):
            g = torch.Generator(device="cuda").manual_seed(n)
            q = torch.randn(1, HQ, W, D, device="cuda", dtype=dtype, generator=g)
            k = torch.randn(1, HKV, n, D, device="cuda", dtype=dtype, generator=g)
            k_pos = torch.arange(n, device="cuda")[None]
            q_pos = k_pos[:, -W:].contiguous()
            sal, ent = window_scores(q, k, q_pos, k_pos, entropy=True)
            ref_sal, ref_ent = window_scores_naive(q, k, q_pos, k_pos, D**-0.5)
            err_s = (sal - ref_sal).abs().max().item()
            err_e = (ent - ref_ent).abs().max().item()
            good = err_s < 1e-4 and err_e < 1e-3
            ok &= good
            t_tri = cuda_time(lambda: window_scores(q, k, q_pos, k_pos))
            t_ref = cuda_time(lambda: window_scores_naive(q, k, q_pos, k_pos, D**-0.5))
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            window_scores(q, k, q_pos, k_pos)
            mem_tri = (torch.cuda.max_memory_allocated() - base) / 2**20
            torch.cuda.reset_peak_memory_stats()
            window_scores_naive(q, k, q_pos, k_pos, D**-0.5)
            mem_ref = (torch.cuda.max_memory_allocated() - base) / 2**20
            rows.append((n, str(dtype).split(".")[-1], err_s, err_e, good, t_tri, t_ref, mem_tri, mem_ref))
            print(rows[-1], flush=True)
    # compact_kv: Triton gather vs the aten reference
    B, H, N, M, C = 1, HKV, 65536, 6553, 8192
    k = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_pos = torch.arange(N, device="cuda")[None]
    idx = torch.stack([torch.randperm(N, device="cuda")[:M].sort().values for _ in range(H)])[None]
    bufs = [(torch.zeros(B, H, C, D, device="cuda", dtype=torch.bfloat16), torch.zeros(B, H, C, D, device="cuda",
             dtype=torch.bfloat16), torch.zeros(B, H, C, dtype=torch.long, device="cuda"))
            for _ in range(2)]
    compact_kv_triton(*bufs[0], k, v, k_pos, idx)
    compact_kv_reference(*bufs[1], k, v, k_pos, idx)
    same = all(torch.equal(a, b) for a, b in zip(*bufs))
    ok &= same
    t_ct = cuda_time(lambda: compact_kv_triton(*bufs[0], k, v, k_pos, idx))
    t_cr = cuda_time(lambda: compact_kv_reference(*bufs[1], k, v, k_pos, idx))
    print(f"\nwindow_scores, w={W}, Hq={HQ}, Hkv={HKV}, D={D}; median of 10 (CUDA events)\n")
    print("| N | dtype | max err saliency | max err entropy | ok | Triton (ms) | materialised torch (ms) | speed-up "
          "| Triton extra MiB | torch extra MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, dt, es, ee, good, tt, tr, mt, mr in rows:
        print(f"| {n} | {dt} | {es:.1e} | {ee:.1e} | {good} | {tt:.3f} | {tr:.3f} | {tr / tt:.2f}x | "
              f"{mt:.0f} | {mr:.0f} |")
    print(f"\ncompact_kv (N={N}, M={M}, bf16): identical={same}, Triton {t_ct:.3f} ms, aten {t_cr:.3f} ms")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
