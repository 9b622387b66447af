"""Token propagation: after a layer, which of the current tokens go on to the deeper layers.

A `Propagation` observes every layer through a `LayerView` and returns, when it decides, the
kept token indices (B, K) into the current tokens (sorted, -1 left padding); the loop then
gathers hidden states, columns and positions with `pruner`. Deeper layers compute only on the
kept tokens: that is the prefill saving. Three rules ship:
- `FixedLayerPropagation` (FastKV's TSP): at one layer, the top tokens by that layer's pooled
  window saliency;
- `StructKVCompressor` (`structkv.modules.compressor`): at each row's detected pivot, the top
  tokens by centrality accumulated over the layers before it;
- GemFilter's (`structkv.methods.gemfilter`): at one layer, the top tokens by the last query's
  logits, re-encoded from layer 0 with renumbered positions (`restart = True`: the loop runs
  `restart_prompt` through the whole model instead of going on).
"""
from __future__ import annotations

import torch
from torch import nn

from .selection import pooled_saliency
from .skeleton import SkeletonPruner


class Propagation(nn.Module):
    """Base: never propagates. `forward(view)` is `after_layer`. `pivots` holds each row's
    propagation layer (None until it fires); `host_syncs` counts the times it reads the device
    during the layer loop (a pipeline stall); `scoring_s` the seconds spent on statistics (not on
    the memoised window scores, which the view accounts for)."""

    restart = False
    host_syncs = 0

    def __init__(self, batch: int, window: int = 0, positions: str = "original"):
        super().__init__()
        self.pivots: list[int | None] = [None] * batch
        self.pruner = SkeletonPruner(window, positions)
        self.scoring_s = 0.0

    def begin(self, num_tokens: int, device=None) -> "Propagation":
        """Start a prompt of `num_tokens` columns (padding included)."""
        return self

    def window_needed(self, layer: int) -> int | None:
        """The observation window whose scores `after_layer` reads at `layer` (None: none)."""
        return None

    def forward(self, view) -> torch.Tensor | None:
        return self.after_layer(view)

    def after_layer(self, view) -> torch.Tensor | None:
        """Kept token indices (B, K) when this layer propagates, else None."""
        return None

    def restart_prompt(self, tokens: torch.Tensor, view, kept: torch.Tensor) -> tuple:
        """For a propagation with `restart = True`: the prompt the loop re-encodes uncompressed
        from layer 0 instead of going on, as (token ids (B, K), positions (B, K), prompt columns
        (B, K), -1 = pad), from the prompt's ids (B, S), the layer's view and the kept indices."""
        raise NotImplementedError(f"{type(self).__name__} sets restart but gives no restart_prompt")

    def guide(self) -> torch.Tensor | None:
        """Scores (B, Hg, N) on prompt columns that may steer every layer's KV retention once
        every row propagated (`GuidedRetention`); None: no guide."""
        return None

    def stats(self) -> dict:
        """Extra entries for the prefill stats (e.g. StructKV's T curves)."""
        return {}


class FixedLayerPropagation(Propagation):
    """At `layer`, keep per row `keep[b]` tokens: the window plus the top by pooled window saliency
    summed over KV heads (FastKV's token-selective propagation)."""

    def __init__(self, layer: int, keep: list[int], window: int, kernel: int, pooling: str | None):
        super().__init__(len(keep), window)
        self.layer, self.keep, self.window, self.kernel, self.pooling = layer, keep, window, kernel, pooling
        # the layer is fixed and the row lengths are known: no read-back (host_syncs stays 0)

    def window_needed(self, layer: int) -> int | None:
        return self.window if layer == self.layer else None

    def after_layer(self, view) -> torch.Tensor | None:
        if view.layer != self.layer:
            return None
        saliency = view.window_scores(self.window)
        score = pooled_saliency(saliency, self.window, self.kernel, self.pooling).sum(1)  # (B, n)
        self.pivots = [self.layer] * len(self.keep)
        return self.pruner.select(score, view.valid, self.keep, view.lengths)
