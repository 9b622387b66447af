"""Ask-time recall: a question chooses, at every archived layer, the context entries its answer reads.

A compressed state keeps its hot set (what the method kept) and, with an archive
(`structkv.models.archive`), every entry the method evicted, stored small. When a question is
asked, its tokens attend over hot set + archive at every layer (the archive dequantized tile by
tile, never whole), so the question is read as it would be with the whole context. Each archived
layer then re-selects, SnapKV-style with the question as the observation window, the `recall`
context entries the question attends to most (attention summed over the question's tokens and
the KV group's heads, max-pooled over neighbouring positions), and the answer decodes from hot
set + recalled entries + the question only. The state is not touched: every question works on
its own copy, so the next question starts from the same hot set and archive.

Why the whole context is scored, hot set included: with a float archive this is SnapKV on the
whole prompt (the question last) at a budget of `recall` entries, exactly; the hot set stays on
top, so the answer never reads less than the query-agnostic compression kept.

Layers past a propagation (StructKV's pivot, FastKV's TSP layer) computed only the tokens that
went on: their archive holds only those, so recall there can bring back what the layer's KV
selection dropped, never a token the skeleton dropped (its earlier layers can still recall it).

Shapes: B batch, Hq / Hkv query / KV heads, G = Hq // Hkv, S question tokens, C hot slots, A
archived entries, P context positions, D head dim.
"""
from __future__ import annotations

from functools import partial

import torch

from .archive_fetch import ArchiveFetch
from .budget import Budget
from .selection import pool_scores, select_tokens

# Entries recalled per archived layer per question, a ratio of the context as R_KV. 0.2: the
# smallest budget within 0.03 of the best worst share of the full cache over both kinds' development
# folders (0.1 / 0.2 / 0.3; research/results/README.md, "Fourth choice"); the archive holds every evicted
# entry whatever the budget, so a larger one costs time per question, not resident memory.
DEFAULT_RECALL = 0.2
TILE = 1024  # archived entries dequantized at a time
# The question's attention max-pooled over 31 neighbouring positions, so a pick brings its sentence
# along (a fact's value sits a few tokens after the words a question matches): chosen on a
# development split over 7 (SnapKV's), 15, 31 and 63 (research/results/recall_kernel_dev/gemma_4k.md:
# best or level for every hot set tried; 7 lost the later digits of the answers)
KERNEL, POOLING = 31, "max"


class RecallLayer:
    """One archived layer as the question's cache: attends over hot set + archive + the question,
    recalls the best `keep[b]` context entries of each row into `answer` (a grown copy of the hot
    layer), then appends the question. `stats` collects what it did (entries recalled, bytes read)."""

    sliding_window = None  # archived layers are full-attention layers

    def __init__(self, answer, archive, keep: list[int], stats: dict, fetch, tile: int = TILE, kernel: int = KERNEL):
        self.answer, self.archive, self.keep, self.stats, self.tile = answer, archive, keep, stats, tile
        self.kernel = kernel
        self.fetch = fetch  # () -> this layer's archive opened on the question's device (`ArchiveFetch.take`)
        self.chosen = None  # (B, Hkv, K) the context positions chosen for the answer, once asked

    def attention(self, attn, q, k, v, positions):
        """The `LayerKVCache.attention` call of several (or one) question tokens: (B, S, E). The
        layer's archive comes opened from `fetch` (a file's read and checked one layer ahead), for
        this layer of this question only."""
        B, Hq, S, D = q.shape
        source, self.archive = self.archive, self.fetch()
        try:
            apos = self.archive.positions()  # (B, Hkv, A)
            out, hot_p, arch_p = self._attend(q, k, v, positions, apos, attn.scale)  # (B, Hq, S, D), probabilities
            self._recall(hot_p, arch_p, positions, apos)
        finally:
            self.archive = source  # the entries read from a file are freed with this layer's question
        self.answer.write(k, v, positions)
        return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))

    def _attend(self, q, k, v, positions, apos, scale):
        """Softmax attention of the question over hot + archive + its own causal keys, and the
        probabilities (B, Hkv, G*S, C) on the hot slots and (B, Hkv, G*S, A) on the archive (rows
        head-major: g * S + s). A KV head's G query heads are folded into the rows of one product
        per (row, KV head), so no key or value tile is broadcast (copied) over G, and one softmax
        runs over a row's every column (hot, question, archive) at once."""
        B, Hq, S, D = q.shape
        Hkv, A = k.shape[1], self.archive.size
        G = Hq // Hkv
        work = self.work_dtype()
        qg = (q.float() * scale).reshape(B, Hkv, G * S, D)  # (B, Hkv, G*S, D)
        qa = qg.to(work)
        hk, hv = self.answer.read(torch.float32)
        new_pos = positions[:, None].expand(-1, Hkv, -1)  # (B, Hkv, S)
        keys, vals = torch.cat([hk, k.float()], 2), torch.cat([hv, v.float()], 2)  # (B, Hkv, N = C + S, D)
        N = keys.shape[2]
        kpos = torch.cat([self.answer.pos, new_pos], 2)
        seen = (kpos[:, :, None] >= 0) & (kpos[:, :, None] <= positions[:, None, :, None])  # (B, Hkv, S, N)
        logits = torch.empty(B, Hkv, G * S, N + A, device=q.device)  # near columns, then the archive's
        torch.matmul(qg, keys.transpose(-1, -2), out=logits[..., :N])
        logits[..., :N].view(B, Hkv, G, S, N).masked_fill_(~seen[:, :, None], float("-inf"))
        for s in range(0, A, self.tile):  # pass 1: keys, tile by tile
            ka = self._tile(s, "k", work)  # (B, Hkv, t, D)
            logits[..., N + s:N + s + ka.shape[2]] = qa @ ka.transpose(-1, -2)
        absent = apos < 0  # (B, Hkv, A): a shorter row's padding
        if bool(absent.any()):
            logits[..., N:].masked_fill_(absent[:, :, None], float("-inf"))
        probs = logits.softmax(-1)  # (B, Hkv, G*S, N + A)
        rows = probs.view(B * Hkv, G * S, N + A)
        out = torch.bmm(rows[..., :N], vals.reshape(B * Hkv, N, D))  # (B*Hkv, G*S, D)
        for s in range(0, A, self.tile):  # pass 2: values, tile by tile, accumulated in float32
            va = self._tile(s, "v", work)  # (B, Hkv, t, D)
            t = va.shape[2]
            p, va = rows[..., N + s:N + s + t], va.reshape(B * Hkv, t, D)
            if work == torch.float32:
                out.baddbmm_(p, va)
            else:
                out += torch.bmm(p.to(work), va)
        C = self.answer.pos.shape[2]
        return out.reshape(B, Hq, S, D).to(q.dtype), probs[..., :C], probs[..., N:]

    def work_dtype(self) -> torch.dtype:
        """The dtype of the archive's products: float32 for a float archive (recall then equals
        query-aware SnapKV exactly), bfloat16 for a quantized one, whose codes carry less than
        bfloat16's precision already: products with float32 accumulation, 4x float32's rate on a
        CPU with AVX512-BF16 (`research/experiments/bf16_products.py`, 1 thread: 100 vs 382-407 GFLOP/s),
        softmax and output sums in float32."""
        return torch.float32 if self.archive.kind == "float" else torch.bfloat16

    def _tile(self, s: int, side: str, dtype=torch.float32) -> torch.Tensor:
        e = min(s + self.tile, self.archive.size)
        self.stats["archive_bytes_read"] += self.archive.tile_bytes(s, e, side)
        return self.archive.tile(s, e, side, dtype)

    def _recall(self, hot_p, arch_p, positions, apos) -> None:
        """Score every context entry by the question's attention, keep the best `keep` per row and
        KV head, and append those the hot set lacks to the answer's layer."""
        hpos = self.answer.pos  # (B, Hkv, C); apos (B, Hkv, A)
        B, Hkv = hpos.shape[:2]
        start = positions[:, :1, None]  # (B, 1, 1): the question starts where each row's context ends
        P = int(start.max())
        scores = torch.zeros(B, Hkv, P + 1, device=hpos.device)
        present = torch.zeros(B, P + 1, dtype=torch.bool, device=hpos.device)
        S = positions.shape[1]
        for p, pos in ((hot_p, hpos), (arch_p, apos)):  # sum over G, mean over S: SnapKV's saliency
            where = torch.where((pos >= 0) & (pos < start), pos, torch.full_like(pos, P))  # P: discarded
            scores.scatter_add_(2, where, p.sum(2) / S)  # p (B, Hkv, G*S, ·): every row of the KV head
            present.scatter_(1, where[:, 0], True)  # every head holds the same columns, hot and archived
        present = present[:, :P]
        chosen = select_tokens(pool_scores(scores[..., :P], self.kernel, POOLING), present, self.keep, 0,
                               present.sum(1).tolist())  # (B, Hkv, K) positions, -1 = none
        self.chosen = chosen
        entry = torch.full((B, Hkv, P + 1), -1, dtype=torch.long, device=hpos.device)  # position -> archive entry
        numbers = torch.arange(apos.shape[2], device=hpos.device).expand_as(apos)
        entry.scatter_(2, torch.where(apos >= 0, apos, torch.full_like(apos, P)), numbers)
        index = entry.gather(2, torch.where(chosen >= 0, chosen, torch.full_like(chosen, P)))  # (B, Hkv, K)
        self.stats["chosen"] += int((chosen >= 0).sum())
        found = index >= 0
        K = int(found.sum(-1).max()) if index.numel() else 0
        self.stats["recalled"] += int(found.sum())
        self.stats["recalled_bytes"] += int(found.sum()) * self.answer.entry_bytes()
        if K == 0:
            return
        order = found.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :K]
        index = index.gather(2, order)  # (B, Hkv, K) archive entries first, -1 = nothing
        ka, va = self.archive.take(index.clamp_min(0))
        pos = torch.where(index >= 0, apos.gather(2, index.clamp_min(0)), torch.full_like(index, -1))
        self.answer.append_entries(ka, va, pos)


def recall_counts(recall, lengths: list[int]) -> list[int]:
    """Entries each row recalls per archived layer for a `Budget` (a ratio of its context or a count)."""
    return Budget.parse(recall, "recall").tokens(lengths)


class _Layers:
    """A cache object of per-layer caches (what `Decoder.run` reads: `layers[i]`)."""

    def __init__(self, layers):
        self.layers = layers


def recall_extend(model, state, tokens: torch.Tensor, positions: torch.Tensor, recall, tile: int = TILE,
                  kernel: int = KERNEL):
    """Extend a copy of `state`'s cache by the question `tokens` (B, S) at `positions` with recall
    from its archive (the state's room must hold the question and the new tokens, as without
    recall). Returns (the answer's cache, the question's last logits (B, V), stats)."""
    from ..models.kv_cache import KVCache

    keep = recall_counts(recall, state.lengths)
    stats = {"recalled": 0, "recalled_bytes": 0, "chosen": 0, "archive_bytes_read": 0, "kernel": kernel}
    answers, seen = [], []
    with ArchiveFetch(state.archive.layers, tokens.device) as fetch:
        for i, layer in enumerate(state.cache.layers):
            archived = state.archive.layers.get(i)
            answer = layer.grown(max(keep) if archived is not None else 0)
            answers.append(answer)
            seen.append(answer if archived is None else
                        RecallLayer(answer, archived, keep, stats, partial(fetch.take, i), tile, kernel))
        logits = model.extend(tokens, positions, _Layers(seen))
    stats["chosen_positions"] = {i: layer.chosen for i, layer in enumerate(seen) if isinstance(layer, RecallLayer)}
    cache = KVCache()
    cache.layers = torch.nn.ModuleList(answers)
    return cache, logits, stats
