"""Custom ops (torch.library), documented in docs/ops.md:
- `window_scores`: observation-window saliency per KV head + attention entropy (CPU reference,
  Triton kernel on CUDA);
- `compact_kv`: in-place KV-cache compaction from selected indices (CPU reference, Triton on CUDA);
- `causal_attention`, `sliding_window_attention`: the prompt pass's blockwise self-attention,
  opaque to a compiled prefill;
- `int8_head_logits`: one row's logits from an exact int8 copy of the LM head;
- `int8_linear`, `int4_linear`: products with weight-only quantized weights (packed CPU kernels);
- `tiled_linear`: `int4_tiled_linear`, `int8_tiled_linear`, the quantized products on x quantized
  per group (C++ built on first use, AVX-512 VNNI or AVX2), what `weights="int4" | "int8"` run
  where it builds;
- `quantized_decode_attention`: one query token over int8 / int4 KV entries (CPU reference,
  Triton on CUDA), with `quantize_kv` / `dequantize_kv`, how the entries are stored;
- `cpu_decode_attention`: the decode attention's CPU kernel (C, built on first use) over float,
  bfloat16, int8 or int4 entries, what a CPU cache's `attend` runs when it is available.
Triton is imported lazily, so the package works where it is absent.
"""
from . import cpu_decode, tiled_linear
from .attention import CAUSAL_BLOCK, causal_attention, decode_attention, sliding_window_attention, visible
from .compaction import compact_kv, compact_kv_reference
from .int8_head import int8_head_logits
from .kv_quant import dequantize_kv, quantize_kv, quantized_decode_attention
from .quantized_linear import int4_linear, int8_linear
from .saliency import window_scores, window_scores_naive, window_scores_reference

__all__ = ["CAUSAL_BLOCK", "causal_attention", "compact_kv", "compact_kv_reference", "cpu_decode", "decode_attention",
           "dequantize_kv", "int4_linear", "int8_head_logits", "int8_linear", "quantize_kv",
           "quantized_decode_attention", "sliding_window_attention", "tiled_linear", "visible", "window_scores",
           "window_scores_naive", "window_scores_reference"]
