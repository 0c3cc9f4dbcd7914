"""TOVA (Oren et al. 2024, "Transformers are multi-state RNNs"), token omission via
attention.

Score: the attention of the last token to every cached entry, averaged over all the
query heads of the layer (so every KV head of a layer keeps the same positions), as the
authors' `TOVACache.reduce` and kvpress `TOVAPress`. After prefill each (layer, KV head)
keeps `budget` entries; the last prompt token is always kept (`keep_last`, kvpress:
"a very slight difference from TOVA"). While decoding, once the cache holds `budget + 1`
entries the one with the lowest score of the current token is evicted, so `budget` stay
live at every step; `keep_last=True` protects the newest token itself (TOVA's code may
evict it; `--set keep_last=false` for that).

Defaults: none beyond the budget (the paper has no window or pooling).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.compression import scoring
from kvjax.compression.eviction import DecodeEviction, force, newest_positions, tail_mask
from kvjax.compression.layer import LayerIO
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class TOVA(DecodeEviction):
    """TOVA: keep the `budget` entries the last token attends to most (mean over all the
    layer's query heads), at prefill and at every decoding step; last token kept."""

    name: ClassVar[str] = "tova"
    forced_what: ClassVar[str] = "the last token"
    budget: int = 128
    keep_last: bool = True

    @property
    def forced(self) -> int:
        return int(self.keep_last)

    def validate(self, n, cfg):
        if not self.keep_last and self.budget < 1:
            raise ValueError(f"budget={self.budget} must be >= 1")
        super().validate(n, cfg)

    def scores(self, io: LayerIO):
        valid = io.valid[:, 0]
        p = scoring.last_token_attention(io.q, io.k, valid)  # [B, K, G, T]
        s = jnp.broadcast_to(jnp.mean(p, axis=(1, 2))[:, None], io.valid.shape)
        return force(s, tail_mask(valid, int(self.keep_last)), valid)

    def decode_scores(self, io: LayerIO, probs, state):
        # the current (last) token's attention, head mean; the heads of a layer keep the
        # same positions in the same slots, so a slot-wise mean is a position-wise mean
        s = jnp.mean(probs[:, :, :, -1], axis=(1, 2))[:, None, :]
        s = jnp.broadcast_to(s, io.valid.shape)
        evictable = ~newest_positions(io, 1) if self.keep_last else jnp.ones_like(io.valid)
        return s, evictable, state
