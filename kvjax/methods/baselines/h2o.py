"""H2O (Zhang et al. 2023, "H2O: heavy-hitter oracle for efficient generative inference
of large language models").

Score: accumulated attention -- every prompt entry's column sum of the causal softmax
over all prompt queries (LAVa paper Eq. 18), then, while decoding, plus each new token's
attention. GQA: mean over the query heads of a KV head (docs/methods.md, "Baselines"). The
budget splits into `recent = int(budget * recent_ratio)` most recent entries (always
kept) and `budget - recent` heavy hitters (the highest accumulated scores among the
rest); authors' code: heavy_ratio = recent_ratio (half each). Eviction runs after prefill
and at every decoding step (one entry per step once the budget is full: the lowest
accumulated score outside the recent window), so `budget` entries stay live.

The prefill column sums run over query blocks of `block` (no more than
[heads, block, n] at a time).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.compression import scoring, selection
from kvjax.compression.eviction import DecodeEviction, force, newest_positions, query_sum, tail_mask
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class H2O(DecodeEviction):
    """H2O: `recent` most recent + `budget - recent` heavy hitters by accumulated
    attention (GQA mean), maintained at every decoding step."""

    name: ClassVar[str] = "h2o"
    forced_what: ClassVar[str] = "the recent window"
    budget: int = 128
    recent_ratio: float = 0.5
    gqa: str = "mean"
    block: int = 256

    def splits_heads(self) -> bool:
        return True  # per-head accumulated attention and top-k

    @property
    def recent(self) -> int:
        return max(1, int(self.budget * self.recent_ratio))

    @property
    def forced(self) -> int:
        return self.recent

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if not 0 <= self.recent_ratio < 1:
            raise ValueError(f"recent_ratio={self.recent_ratio} outside [0, 1)")
        super().validate(n, cfg)

    def acc_scores(self, io: LayerIO):
        valid = io.valid[:, 0]
        acc = scoring.cumulative_attention(io.q, io.k, io.qpos, valid, io.pos, io.valid,
                                           self.block, io.tiled, io.lse)
        return jnp.where(io.valid, scoring.gqa_reduce(acc, self.gqa), 0.0)

    def scores(self, io: LayerIO):
        valid = io.valid[:, 0]
        return force(self.acc_scores(io), tail_mask(valid, self.recent), valid)

    def after_layer_prefill(self, io: LayerIO, state):
        """The kept entries, and their accumulated scores (the decode state's start)."""
        T = io.k.shape[2]
        acc = self.acc_scores(io)
        s = force(acc, tail_mask(io.valid_BT, self.recent), io.valid_BT)
        idx, live = self.choose(io, s, self.head_budgets(io, s, state), self.cache_slots(T, io.cfg))
        kv = selection.gather_kept(io.kv, idx, live, io.kernels.compact)
        return kv, jnp.where(kv.valid, jnp.take_along_axis(acc, idx, axis=-1), 0.0), state

    def finalize(self, kv, acc, state):
        kv, _, stats = super().finalize(kv, None, None)
        return kv, acc, stats  # decode state: accumulated scores per slot [L, B, K, S]

    def pad_state(self, acc, capacity: int):
        return jnp.pad(acc, [(0, 0)] * 3 + [(0, capacity - acc.shape[-1])])

    def decode_scores(self, io: LayerIO, probs, acc):
        add = scoring.gqa_reduce(query_sum(probs, io.qvalid), self.gqa)  # [B, K, C]
        layer_acc = io.at_layer(acc) + add
        return layer_acc, ~newest_positions(io, self.recent), io.set_layer(acc, layer_acc)

    def on_evict(self, gone, io: LayerIO, acc):
        return io.set_layer(acc, jnp.where(gone, 0.0, io.at_layer(acc)))
