"""Observed attention (kvpress `ObservedAttentionPress`; H2O-style, Zhang et al. 2023).

Score: each prompt entry's attention summed over every prompt query that sees it,
divided by how many do (`n - i` for the entry at position i), averaged over the query
heads of a KV head (GQA mean). Each (layer, KV head) keeps the top `budget`; evicts only
after prefill (no decode-time eviction -- `h2o` does that).

No window by default (kvpress): even the last prompt token competes (its column is its
self-attention, divided by 1) and may be evicted; `--set window=w` forces the last w.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.compression import scoring
from kvjax.compression.eviction import PrefillEviction, force, tail_mask
from kvjax.compression.layer import LayerIO
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class ObservedAttention(PrefillEviction):
    """Observed attention: top `budget` per (layer, KV head) by mean received attention
    (column sum / number of queries), GQA mean; no forced window (kvpress)."""

    name: ClassVar[str] = "observed_attention"
    budget: int = 128
    window: int = 0
    gqa: str = "mean"
    block: int = 256

    def splits_heads(self) -> bool:
        return True  # per-head observed attention and top-k

    def scores(self, io: LayerIO):
        valid = io.valid[:, 0]
        s = scoring.gqa_reduce(
            scoring.observed_attention(io.q, io.k, io.pos[:, 0], valid, self.block, io.tiled,
                                       io.lse),
            self.gqa)
        return force(s, tail_mask(valid, self.window), valid)
