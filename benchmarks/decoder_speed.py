"""Decoder speed on Gemma 3 270M: structkv compiled and eager vs transformers (sdpa), side by side.

Prefill latency at several prompt lengths and decode tokens/s at a 4K context; one warm-up,
then `--repeats` timed runs; medians, spreads and ratios printed as a markdown table.

    python benchmarks/decoder_speed.py [--lengths 1024,4096,8192] [--repeats 3] [--json out.json]
    python benchmarks/decoder_speed.py --lengths none --repeats 5   # decode only

Decode is also timed with the exact int8 copy of the LM head (`model.use_int8_head()`: the GGUF's
Q8_0 head as int8 codes + block scales, same numbers; greedy tokens checked equal).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import structkv
from structkv.harness.eval.sources import needle_prompt
from structkv.runtime.generation import compiled_prefill


def hf_twin(model):
    """transformers' Gemma3ForCausalLM (sdpa) holding exactly our weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    c = model.config
    cfg = Gemma3TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        sliding_window=c.sliding_window, layer_types=list(c.layer_types), query_pre_attn_scalar=c.head_dim,
        rope_parameters={t: {"rope_type": "default", "rope_theta": r.theta} for t, r in c.rope.items()},
        tie_word_embeddings=True, attn_implementation="sdpa")
    hf = Gemma3ForCausalLM(cfg)
    ours = {k: v for k, v in model.state_dict().items() if not k.startswith("inv_freq")}
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    if unexpected or any("weight" in k for k in missing if k != "lm_head.weight"):
        raise RuntimeError(f"weight names differ: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()


def timed(fn, repeats):
    fn()  # warm-up (compiles on first use)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [] if args.lengths == "none" else [int(x) for x in args.lengths.split(",")]

    model = structkv.load("gemma-3-270m")
    hf = hf_twin(model)
    prompts = {n: torch.tensor([needle_prompt(model.tokenizer, n, 0.5).prompt_ids]) for n in lengths}
    ids = torch.tensor([needle_prompt(model.tokenizer, 1024, 0.5).prompt_ids])
    assert torch.allclose(hf(ids).logits.float(), model(ids), atol=1e-3), "transformers twin differs"

    def ours_prefill(tokens, comp):
        pos = torch.arange(tokens.shape[1])[None]
        if comp:
            torch._dynamo.mark_dynamic(tokens, 1, min=2, max=model.config.max_position_embeddings)
            torch._dynamo.mark_dynamic(pos, 1, min=2, max=model.config.max_position_embeddings)
            return compiled_prefill()(model, tokens, pos)
        return model.prompt_pass(tokens, pos)

    rows = []
    warm = ids
    for name, fn in [] if not lengths else [("structkv compiled", lambda t: ours_prefill(t, True)),
                     ("structkv eager", lambda t: ours_prefill(t, False)),
                     ("transformers sdpa", lambda t: hf(t, use_cache=True, logits_to_keep=1))]:
        fn(warm)  # compile / warm caches once for all lengths
        for n in lengths:
            times = timed(lambda: fn(prompts[n]), args.repeats)
            rows.append({"impl": name, "phase": "prefill", "tokens": n, "median_s": statistics.median(times),
                         "min_s": min(times), "max_s": max(times)})
            print(rows[-1], flush=True)

    ctx = torch.tensor([needle_prompt(model.tokenizer, args.decode_context, 0.5).prompt_ids])
    n_new = args.decode_tokens

    def ours_decode(comp, int8=False):
        model.int8_head = head if int8 else None
        out = structkv.generate(model, ctx[0].tolist(), max_new_tokens=n_new, stop_at_eos=False, compile=comp)
        model.int8_head = None
        tokens[int8] = out.token_ids
        return out.stats["decode_tokens_per_s"]

    head, tokens = model.use_int8_head().int8_head, {}
    model.int8_head = None

    def hf_decode():
        out = hf(ctx, use_cache=True, logits_to_keep=1)
        pkv, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(n_new - 1):
            out = hf(tok, past_key_values=pkv, use_cache=True)
            pkv, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return (n_new - 1) / (time.perf_counter() - t)

    for name, fn in [("structkv compiled", lambda: ours_decode(True)), ("structkv eager", lambda: ours_decode(False)),
                     ("structkv compiled int8 head", lambda: ours_decode(True, int8=True)),
                     ("transformers sdpa", hf_decode)]:
        fn()  # warm-up
        rates = [fn() for _ in range(args.repeats)]
        rows.append({"impl": name, "phase": "decode", "tokens": args.decode_context,
                     "median_tok_s": statistics.median(rates), "min_tok_s": min(rates), "max_tok_s": max(rates)})
        print(rows[-1], flush=True)

    def get(impl, phase, n, key):
        return next(r[key] for r in rows if r["impl"] == impl and r["phase"] == phase and r["tokens"] == n)

    print(f"\nGemma 3 270M, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}; median of {args.repeats} after 1 warm-up\n")
    print("| prompt tokens | structkv compiled (s) | structkv eager (s) | transformers sdpa (s) | HF / compiled |")
    print("|---|---|---|---|---|")
    for n in lengths:
        c, e, h = (get(i, "prefill", n, "median_s")
                   for i in ("structkv compiled", "structkv eager", "transformers sdpa"))
        print(f"| {n} | {c:.2f} | {e:.2f} | {h:.2f} | {h / c:.2f}x |")
    assert tokens[True] == tokens[False], "the int8 head changed the greedy tokens"
    c, e, q, h = (get(i, "decode", args.decode_context, "median_tok_s")
                  for i in ("structkv compiled", "structkv eager", "structkv compiled int8 head", "transformers sdpa"))
    print(f"\n| decode at {args.decode_context} context | structkv compiled | structkv eager | structkv compiled, "
          f"int8 head | transformers sdpa | compiled / HF | int8 head / HF |\n|---|---|---|---|---|---|---|\n"
          f"| tokens/s | {c:.1f} | {e:.1f} | {q:.1f} | {h:.1f} | {c / h:.2f}x | {q / h:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
