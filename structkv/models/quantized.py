"""Weight-only quantized linears: `weights="bf16" | "int8" | "int4"` (`structkv.models.load`).

Why: decode on a CPU is bound by reading the weights once per token (Gemma 3 270M: 1.07 GB in
float32, most of it the 262K-row tied LM head), so the bytes per weight set the speed. The
activations, norms, attention and KV stay in the model's dtype; only the matrix products read
smaller weights, through PyTorch's packed CPU kernels (`structkv.ops.quantized_linear`; a long
prompt unpacks each weight to bf16 once and runs a GEMM, measured faster there):

- "bf16": the weight in bfloat16 (2 bytes).
- "int8": int8 codes with one scale per output row (1 byte).
- "int4": 4-bit codes in groups of `INT4_GROUP` input columns with a scale and a minimum per
  group (0.625 bytes with the group's two 16-bit numbers).

Both run, on a CPU where structkv's kernels build with a vector path, `layout="tiled"`
(`structkv.ops.tiled_linear`: x quantized per group of 32 to int8, integer products 16 output
rows at a time, as llama.cpp's Q4 / Q8 kernels do; int4 tables in float16). Elsewhere, or with
`layout="packed"`: PyTorch's `aten._weight_int8pack_mm` / `aten._weight_int4pack_mm_for_cpu`
(bf16 tables), a compiled decode step's int8 row as a reduction inductor fuses (`int8_row_fused`).

PyTorch's packed kernels take bfloat16 activations (their float32 paths are a slow fallback: 20-30x
slower, measured), so a product there rounds its input to bfloat16 and returns the model's dtype.
A GGUF file's blocks are dequantized at load and quantized again here: Q8_0 and Q4_0/Q4_1 blocks
of 32 are not bit-exact in these forms (per-row int8 scales; bf16 group scales) and
`research/benchmarks_log.md` reports the measured loss instead (logit KL to float32, RULER).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import tiled_linear
from ..ops.int8_head import int8_head_logits
from ..ops.quantized_linear import (
    DENSE_ROWS,
    int4_linear,
    int4_product,
    int4_weight,
    int8_linear,
    int8_product,
    int8_row_fused,
)
from ..util.compiling import forget_structure
from .huge_pages import place_on_huge_pages

WEIGHTS = ("fp32", "bf16", "int8", "int4")
INT4_GROUP = 32  # GGUF's block size (Q4_0, Q4_1, Q5_0, Q8_0); the kernel takes 32, 64, 128 or 256
INT4_TILES = 2  # inner K tiles of the CPU int4 packing
LAYOUTS = ("tiled", "packed")  # int8 / int4 storage: structkv's tiled kernels or PyTorch's packing


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    return weights


def int4_fits(out_features: int, in_features: int) -> bool:
    """The CPU int4 packing needs rows in multiples of 16 and whole groups per row."""
    return out_features % 16 == 0 and in_features % INT4_GROUP == 0


class QuantizedLinear(nn.Module):
    """A bias-free or biased linear whose weight (N, K) is stored as `kind` ("bf16", "int8",
    "int4"); `forward(x)` for x (..., K) -> (..., N) in x's dtype. `reduce` (a callable, e.g. a
    tensor-parallel all-reduce) is applied to the product before the bias, as the row-parallel
    projection does."""

    def __init__(self, kind: str, in_features: int, out_features: int, bias: torch.Tensor | None = None,
                 reduce=None, head: bool = False):
        super().__init__()
        self.kind, self.in_features, self.out_features, self.reduce = kind, in_features, out_features, reduce
        self.head = head  # the LM head: its one row runs compiled on its own (see `forward`)
        self.sizes = None  # the parts' output widths where this is several projections in one (`fuse_projections`)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, kind: str, bias: torch.Tensor | None = None,
                    reduce=None, head: bool = False, layout: str | None = None) -> "QuantizedLinear":
        """Quantize a float weight (N, K). "int4" on a shape the packing cannot take raises.
        `layout` of int8 / int4: "tiled" (structkv's kernels, `structkv.ops.tiled_linear`) or
        "packed" (PyTorch's packed kernels and inductor's int8 reduction); by default the tiled one
        where its kernels built with a vector path and the shape tiles (`default_layout`)."""
        N, K = weight.shape
        mod = cls(kind, K, N, bias, reduce, head)
        w = weight.detach().float()
        if kind not in ("bf16", "int8", "int4"):
            raise ValueError(f"QuantizedLinear kinds are bf16, int8, int4, got {kind!r}")
        if kind == "bf16":
            mod.register_buffer("weight", w.to(torch.bfloat16))
            return mod
        if kind == "int4" and not int4_fits(N, K):
            raise ValueError(f"int4 weights need out_features % 16 == 0 and in_features % {INT4_GROUP} == 0, "
                             f"got ({N}, {K}); use weights='int8' for this model")
        mod.layout = layout or default_layout(weight.device, N, K)
        if mod.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if mod.layout == "tiled" and not (tiled_linear.loaded() and tiled_linear.fits(N, K)):
            why = tiled_linear.unavailable_reason() or "built"
            raise ValueError(f"layout='tiled' needs structkv's tiled kernels ({why}) and a ({N}, {K}) weight with "
                             "N % 16 == 0 and K % 32 == 0; use layout='packed'")
        if kind == "int8":
            # the kernel's scale is bf16: round it up a hair so the largest weight still fits in 127 steps,
            # and round the codes against the scale it will use
            scales = ((w.abs().amax(1) / 127) * (1 + 2**-8)).clamp(min=1e-30).to(torch.bfloat16)  # (N,)
            codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
            mod.register_buffer("scales", scales)
            if mod.layout == "tiled":
                mod.register_buffer("tiles", tiled_linear.pack_int8(codes))
            else:
                mod.register_buffer("codes", codes)
        elif mod.layout == "tiled":
            tiles = tiled_linear.pack_int4(*tiled_linear.quantize_int4(w))
            for name, t in zip(("tiles", "tile_scale", "tile_min"), tiles):
                mod.register_buffer(name, t)
        else:
            codes, scale_zero = _int4_groups(w)
            mod.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_TILES))
            mod.register_buffer("scale_zero", scale_zero)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self._product(x.reshape(-1, self.in_features))  # (..., K) -> (M, K) -> (M, N)
        y = y.to(x.dtype).view(*lead, self.out_features)  # (M, N) -> (..., N)
        if self.reduce is not None:
            y = self.reduce(y)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) -> (M, N). The tiled layouts: one C++ op for every row count (it picks integer
        rows or a GEMM itself), reached through the dispatcher without a Python layer, on the
        model's float x. The packed ones: one row (a decode step) compiled: int8 as a reduction
        inductor fuses (`int8_row_fused`, faster than the packed kernel there on an AVX-512 machine,
        on float32 x), except the LM head, a graph of its own (`int8_head_logits`: in the decode
        graph inductor fused the final norm into its loop, SmolLM2 87 -> 62 tokens/s); int4 calls
        the packed kernel directly, so it sits in the graph without the opaque op's Python call (~9
        us, 7 per layer per token). Other row counts go through the op, which picks packed or GEMM at
        run time: in a prefill compiled for any length, a test of the count would be a guard on the
        length ("== 1" is not: dynamic sizes start at 2). The packed kernels take bf16 x."""
        if self.kind != "bf16" and self.layout == "tiled":
            if self.kind == "int8":
                return tiled_linear.int8_tiled_linear(x, self.tiles, self.scales, DENSE_ROWS)
            return tiled_linear.int4_tiled_linear(x, self.tiles, self.tile_scale, self.tile_min, DENSE_ROWS)
        one = x.shape[0] == 1
        if self.kind == "int8" and one and torch.compiler.is_compiling():
            x = x.float()
            if self.head:
                return int8_head_logits(x, self.codes, self.scales.float()[:, None])
            return int8_row_fused(x, self.codes, self.scales)
        x = x.to(torch.bfloat16)
        if self.kind == "bf16":
            return F.linear(x, self.weight)
        if self.kind == "int8":
            return (int8_product if one else int8_linear)(x, self.codes, self.scales)
        return (int4_product if one else int4_linear)(x, self.packed, self.scale_zero, INT4_GROUP)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (N, K) these codes stand for, as the kernel computes with it (tests)."""
        if self.kind != "int4":
            return self.rows(torch.arange(self.out_features, device=next(self.buffers()).device))
        if self.layout == "tiled":
            return torch.ops.structkv.int4_tiled_weight(self.tiles, self.tile_scale, self.tile_min)
        return int4_weight(self.packed, self.scale_zero, INT4_GROUP, self.in_features).float()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Float32 rows `index` (...,) -> (..., K): the tied embedding's lookup (bf16 and int8; the
        int4 packing is opaque, so the tied head stays int8 under int4 weights)."""
        if self.kind == "bf16":
            return self.weight[index].float()
        if self.kind == "int8":
            codes = tiled_linear.int8_rows(self.tiles, index) if self.layout == "tiled" else self.codes[index]
            return codes.float() * self.scales[index].float()[..., None]
        raise ValueError("int4 weights have no row lookup; the embedding uses an int8 copy")

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        layout = f" ({self.layout})" if self.kind != "bf16" else ""
        parts = f", parts={self.sizes}" if self.sizes else ""
        return f"{self.kind}{layout}, in_features={self.in_features}, out_features={self.out_features}{parts}"


def default_layout(device: torch.device, out_features: int, in_features: int) -> str:
    """"tiled" on a CPU where structkv's tiled kernels built with a vector path and the shape
    tiles, else "packed"."""
    fast = device.type == "cpu" and tiled_linear.available()
    return "tiled" if fast and tiled_linear.fits(out_features, in_features) else "packed"


def _int4_groups(w: torch.Tensor):
    """Asymmetric 4-bit codes per group of INT4_GROUP columns: codes (N, K) int32 in 0..15 and
    the kernel's (K / group, N, 2) bf16 table of (scale, zero), where w = (code - 8) * scale + zero."""
    N, K = w.shape
    groups = w.view(N, K // INT4_GROUP, INT4_GROUP)  # (N, G, group)
    low, high = groups.amin(-1), groups.amax(-1)  # (N, G)
    scale = ((high - low) / 15).clamp(min=1e-12)
    scale_b = scale.to(torch.bfloat16).float()  # the kernel's precision: round the codes against it
    codes = torch.round((groups - low[..., None]) / scale_b[..., None]).clamp(0, 15)
    zero = low + 8 * scale_b
    table = torch.stack([scale_b.t(), zero.t()], -1).to(torch.bfloat16).contiguous()  # (G, N, 2)
    return codes.to(torch.int32).view(N, K), table


FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")  # GGUF types of at most 4 bits a weight
FLOAT = ("F32", "F16", "BF16", "F64")


def int4_or_int8(shape: tuple[int, int], source: str | None) -> str:
    """The storage of one projection under weights="int4": int4 where the file stores it in 4
    bits (kept as it has it) or as floats (quantized at load); int8 where the file chose more bits
    (Q5_0, Q6_K, Q8_0: llama.cpp's Q4_K_M keeps them for the sensitive tensors, and a 4-bit code
    would coarsen them: KL to float32 0.28 instead of 0.01 on Gemma 3 270M) or the shape does not
    pack."""
    if not int4_fits(*shape):
        return "int8"
    return "int4" if source is None or source in FOUR_BIT or source in FLOAT else "int8"


class QuantizedEmbedding(nn.Module):
    """Token embeddings read from a `QuantizedLinear`'s rows: the tied LM head itself (one copy
    of the 262K x 640 matrix, not two) or the embedding's own int8 / bf16 rows."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens).to(self.dtype)  # (B, S) -> (B, S, E)


# Projections that read the same x, computed as one product once quantized: x is read (and, for the
# integer kernels, rounded) once and one call replaces two or three. A decode step of a 30-layer model
# makes 4 products a layer instead of 7; the per-call cost (~7 us through the dispatcher, measured)
# is most of a small projection's time. Rows are quantized on their own (per row, per group), so the
# fused codes are the parts' codes stacked: the same numbers.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(parts: list[nn.Linear], kind: str) -> QuantizedLinear:
    """One `QuantizedLinear` of `kind` for float linears reading the same x: their weights (and
    biases) stacked by output rows; `sizes` holds each part's output width for the split."""
    biases = [p.bias for p in parts]
    if any(b is not None for b in biases):
        biases = [b if b is not None else p.weight.new_zeros(p.out_features) for p, b in zip(parts, biases)]
    bias = torch.cat(biases) if biases[0] is not None else None
    fused = QuantizedLinear.from_weight(torch.cat([p.weight for p in parts]), kind, bias)
    fused.sizes = tuple(p.out_features for p in parts)
    return fused


def quantize_model(model, weights: str, fuse: bool = True) -> None:
    """Swap every projection and the LM head of a Decoder for `QuantizedLinear`s of `weights`, and
    the embedding for rows of the (tied) head, in place. The head and the embedding are int8 under
    "int4" (as llama.cpp's Q4 files keep 6-8 bit outputs: the head's error reaches every logit).
    `fuse`: q/k/v and gate/up become one product each (`FUSED`) where they share a storage kind."""
    if check_weights(weights) == "fp32":
        return
    if model.device.type != "cpu" and weights in ("int8", "int4"):
        raise ValueError(f"weights={weights!r} runs on PyTorch's packed CPU kernels; on {model.device.type} "
                         "use weights='bf16'")
    dtype, tied = model.dtype, model.lm_head.weight is model.model.embed_tokens.weight
    for i, block in enumerate(model.model.layers):
        for part, parent in (("self_attn", block.self_attn), ("mlp", block.mlp)):
            kinds = {}
            for name, old in list(parent.named_children()):
                if isinstance(old, nn.Linear):
                    source = model.source_types.get(f"model.layers.{i}.{part}.{name}.weight")
                    kinds[name] = int4_or_int8(tuple(old.weight.shape), source) if weights == "int4" else weights
            for fused, names in FUSED.items():
                if fuse and names[0] in kinds and len({kinds[n] for n in names}) == 1:
                    setattr(parent, fused, fuse_projections([getattr(parent, n) for n in names], kinds[names[0]]))
                    for n in names:
                        delattr(parent, n)
                        del kinds[n]
            for name, kind in kinds.items():
                old = getattr(parent, name)
                setattr(parent, name, QuantizedLinear.from_weight(old.weight, kind, old.bias,
                                                                  getattr(old, "tp", None) and old.tp.all_reduce))
    outer = "bf16" if weights == "bf16" else "int8"
    head = QuantizedLinear.from_weight(model.lm_head.weight, outer, head=True)
    table = head if tied else QuantizedLinear.from_weight(model.model.embed_tokens.weight, outer)
    model.lm_head, model.model.embed_tokens = head, QuantizedEmbedding(table, dtype)
    model.weights = weights
    place_on_huge_pages(model, (QuantizedLinear,))  # decode streams them: 2 MB pages (structkv.models.huge_pages)
    forget_structure(model)  # its modules changed in place: compiled graphs must not take it for the old one
