"""How a query reads one layer's KV entries: the CPU decode kernel where it is built and fits,
SDPA for float entries, `structkv::quantized_decode_attention` for quantized ones; several new
tokens attend over the entries and each other. A mixin of `LayerKVCache` (`kv_cache.py`), which
holds the planes (`k`, `v`, their tables), `pos`, `kernel` and `threads` it reads.

Shapes: B rows, Hq / Hkv query / KV heads, S new tokens, C slots, D head dim.
"""
from __future__ import annotations

import torch

from ..ops import cpu_decode, decode_attention, visible
from ..ops.kv_quant import quantized_decode_attention


class AttentionDispatch:
    """`attend` (one query token over the entries) and `attention` (new tokens, appended)."""

    def _kernel_kind(self, q: torch.Tensor) -> str | None:
        """The CPU decode kernel's name for this layer's entries, or None where it does not apply."""
        kind = self.kv_dtype or str(self.k.dtype).removeprefix("torch.")
        return kind if self.kernel and cpu_decode.fits(q, self.k) and kind in cpu_decode.KINDS else None

    def attend(self, q: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """One query token per row over this layer's entries: q (B, Hq, 1, D), mask (B, 1|Hkv, 1, C)
        -> (B, Hq, 1, D). On CPU, where it is built, the decode kernel reads every kind of entry
        (`structkv::cpu_decode_attention`); otherwise float entries go to SDPA (`decode_attention`)
        and quantized ones to `structkv::quantized_decode_attention`."""
        kind = self._kernel_kind(q)
        if kind is not None:
            k_planes, v_planes = self._sides()
            return torch.ops.structkv.cpu_decode_attention(q, k_planes, v_planes, mask, scale, kind, self.threads)
        if self.kv_dtype is None:
            return decode_attention(q, self.k, self.v, mask, scale, self.threads)
        k_planes, v_planes = self._sides()
        return quantized_decode_attention(q, k_planes, v_planes, mask, scale, self.kv_dtype)

    def attention(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """New tokens q (B, Hq, S, D), k, v (B, Hkv, S, D) at `positions` (B, S) attend to the entries
        and causally to each other, and are appended: (B, S, E) after `attn`'s output projection.
        One token is written first and reads the buffer in place (decode); several attend over
        entries + new and are written after (a ring could otherwise overwrite keys an earlier new
        token still sees)."""
        if q.shape[2] == 1:
            if self.query_slots:
                self._keep_query(q * attn.scale, positions)
            self.write(k, v, positions)
            kind = self._kernel_kind(q)
            if kind is not None:  # the kernel decides from the slots' positions: no mask built a layer
                k_planes, v_planes = self._sides()
                out = torch.ops.structkv.cpu_decode_attention_at(q, k_planes, v_planes, self.pos, positions,
                                                                 attn.sliding_window or 0, attn.scale, kind,
                                                                 self.threads)
            else:
                out = self.attend(q, visible(positions, self.pos, attn.sliding_window), attn.scale)  # (B, Hq, 1, D)
            return attn.o_proj(out.reshape(q.shape[0], 1, -1))
        old_k, old_v = self.read(k.dtype)
        new_pos = positions[:, None].expand(-1, k.shape[1], -1)  # (B, Hkv, S)
        keys = (torch.cat([old_k, k], 2), torch.cat([old_v, v], 2), torch.cat([self.pos, new_pos], 2))
        out = attn.attend(q, keys[0], keys[1], visible(positions, keys[2], attn.sliding_window))
        self.write(k, v, positions)
        return out
