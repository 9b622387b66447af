"""The decode step's fixed cost: what a step costs when the model does almost no arithmetic.

The same `structkv.generate` path (compiled decode step, sampling on the device, stop checks every
`STOP_CHECK_EVERY` steps) runs a real model and a 1-layer model of hidden size 64 and vocabulary
96 (its arithmetic is ~1 microsecond a token): the second one's time per token is the Python,
guard, cache-write and sampling overhead every step pays; its share of the real model's step is
what a faster kernel can no longer remove.

    python research/experiments/decode_overhead.py --model gemma-3-270m --weights fp32,int8 --threads 2
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def tiny_folder(layers: int = 1) -> Path:
    import torch
    from safetensors.torch import save_file

    from structkv.models.config import ModelConfig
    from structkv.models.decoder import Decoder

    hf = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
              tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_hf(hf))
    folder = Path(tempfile.mkdtemp(prefix="tiny-decoder-"))
    (folder / "config.json").write_text(json.dumps(hf))
    weights = {k: torch.ones_like(v) if "norm" in k else v.contiguous()  # norms start uninitialised
               for k, v in model.state_dict().items() if "inv_freq" not in k and k != "lm_head.weight"}
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def tokens_per_s(model, prompt_len: int, new_tokens: int, repeats: int) -> float:
    import structkv

    ids = [i % (model.config.vocab_size - 1) + 1 for i in range(prompt_len)]
    structkv.generate(model, ids, max_new_tokens=new_tokens, stop_at_eos=False, compile=True)  # compile
    runs = [structkv.generate(model, ids, max_new_tokens=new_tokens, stop_at_eos=False, compile=True)
            .stats["decode_tokens_per_s"] for _ in range(repeats)]
    return sorted(runs)[len(runs) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--weights", default="fp32,int8")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny-layers", type=int, default=0,
                    help="also time a tiny decoder of this many layers (the real model's count): the "
                         "difference to the 1-layer one, per layer, is each layer's fixed cost")
    args = ap.parse_args(argv)
    import torch

    import structkv

    torch.set_num_threads(args.threads)
    tiny = tokens_per_s(structkv.load(str(tiny_folder())), args.prompt, args.new_tokens, args.repeats)
    print(f"1-layer tiny decoder: {tiny:.0f} tok/s = {1e3 / tiny:.2f} ms per step of fixed cost")
    for w in args.weights.split(",") if args.tiny_layers > 1 else []:
        # both depths with the same weights, so the difference is the layers' and nothing else
        shallow, deep = (tokens_per_s(structkv.load(str(tiny_folder(n)), weights=w), args.prompt, args.new_tokens,
                                      args.repeats) for n in (1, args.tiny_layers))
        per_layer = (1e3 / deep - 1e3 / shallow) / (args.tiny_layers - 1)
        print(f"{args.tiny_layers}-layer tiny decoder, {w} weights: {1e3 / deep:.2f} ms per step; "
              f"{1e3 * per_layer:.1f} us per layer of fixed cost")
    for w in args.weights.split(","):
        real = tokens_per_s(structkv.load(args.model, weights=w), args.prompt, args.new_tokens, args.repeats)
        print(f"{args.model} {w}: {real:.1f} tok/s = {1e3 / real:.1f} ms per step; fixed cost "
              f"{100 * real / tiny:.1f} % of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
