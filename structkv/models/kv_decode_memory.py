"""What a decode-time KV bound keeps beside a layer's entries: a ring of the last decode queries
(what the query-based rules score with) and a carried centrality per position (the "centrality"
rule: `structkv.modules.decode_rules`). A mixin of `LayerKVCache` (`kv_cache.py`); both are
buffers of the layer, so rows taken, stacked or resized carry them along.

Shapes: B rows, Hq query heads, D head dim, P positions.
"""
from __future__ import annotations

import torch


class DecodeMemory:
    """`keep_queries` / `_keep_query` (the ring), `carry_centrality` (the table), `take_queries`
    (both, from another layer's rows)."""

    def keep_queries(self, slots: int, num_heads: int) -> None:
        """Keep the last `slots` decode queries, already scaled, in a ring: q_recent (B, Hq, slots,
        D) float32 and q_pos (B, slots) (-1 empty). What a decode-time eviction scores the entries
        with (`structkv.modules.decode_bound`: SnapKV's observation window, on generated tokens)."""
        if self.query_slots == slots:
            return
        B, device = self.pos.shape[0], self.pos.device
        self.query_slots = slots
        self.register_buffer("q_recent", torch.zeros(B, num_heads, slots, self.head_dim, device=device))
        self.register_buffer("q_pos", torch.full((B, slots), -1, dtype=torch.long, device=device))

    def take_queries(self, other: "DecodeMemory", rows: torch.Tensor | None = None, at: int = 0) -> None:
        """Carry `other`'s decode-time memory, its kept queries and its carried centrality (its
        `rows`, default all), into this layer's rows from `at`."""
        if other.query_slots:
            self.keep_queries(other.query_slots, other.q_recent.shape[1])
            q, qp = (other.q_recent, other.q_pos) if rows is None else (other.q_recent[rows], other.q_pos[rows])
            self.q_recent[at:at + q.shape[0]] = q
            self.q_pos[at:at + q.shape[0]] = qp
        if other.carried is not None:
            c, u = other.carried, other.carried_upto
            if rows is not None:
                c, u = c[rows], u[rows]
            self.carry_centrality(c.shape[1])
            self.carried[at:at + c.shape[0], :c.shape[1]] = c
            self.carried_upto[at:at + c.shape[0]] = u

    def carry_centrality(self, positions: int) -> None:
        """Hold a score per position, carried (B, P >= `positions`) float32, across decode steps (the
        "centrality" rule of `structkv.modules.decode_bound`: StructKV's centrality from the prefill,
        accumulated over decode queries); grown, never shrunk. A table per position, not per slot,
        so compaction, resizing and rings leave it as it is."""
        B, device = self.pos.shape[0], self.pos.device
        if self.carried is None:
            self.carried = torch.zeros(B, positions, device=device)
            self.carried_upto = torch.full((B,), -1, dtype=torch.long, device=device)
        elif self.carried.shape[1] < positions:
            self.carried = torch.nn.functional.pad(self.carried, (0, positions - self.carried.shape[1]))

    def _keep_query(self, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Write one scaled query per row, q (B, Hq, 1, D) at positions (B, 1), into the ring."""
        B, Hq = q.shape[:2]
        slot = torch.remainder(positions, self.query_slots)  # (B, 1)
        rows = torch.arange(B, device=q.device).view(B, 1)
        heads = torch.arange(Hq, device=q.device).view(1, Hq, 1)
        self.q_recent.index_put_((rows[:, None], heads, slot[:, None]), q.float())  # (B, Hq, 1) <- (B, Hq, 1, D)
        self.q_pos.index_put_((rows, slot), positions)
