"""Post-prefill eviction: score every prompt entry, allocate budgets, keep the top, compact.

The shared core of SnapKV, PyramidKV, AdaKV, StreamingLLM, TOVA, H2O and observed
attention. Inside the prefill's layer scan, after each layer's attention, a method
1. scores the layer's prompt entries per KV head (`scores`: forced entries -- window,
   sinks, recent -- at +inf, padding at -inf),
2. decides how many each head keeps (`head_budgets`: a uniform or per-layer count, or the
   counts of a flattened top-k),
3. chooses which (`choose`: the top `count` per head; a wrapper such as CriticalKV passes
   its own rule to `evict_layer`), and
4. gathers them into S = `cache_slots(T, cfg)` static slots, ascending by position, dead
   slots after (`kvjax.compression.selection`).
So the full-prompt KV of all layers never exists at once, and one compiled program
serves every budget of the same static slot count.

Decode-time eviction (`DecodeEviction`: H2O, TOVA, StreamingLLM) keeps the budget fixed
at every step: the cache has `budget + max(question, 1)` slots; each new token is
written into a dead slot (`decode_slots`), attends, and then the layer hook evicts the
`live - budget` lowest-scoring evictable entries (`decode_layer`), so exactly `budget`
entries are live after every step. A context-only question chunk of T tokens is written
into T dead slots the same way and evicted back down to the budget right after it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax import pallas
from kvjax.compression import selection
from kvjax.compression.layer import LayerIO, LayerKV
from kvjax.compression.method import Method
from kvjax.compression.scoring import GQA_REDUCTIONS, POOLINGS
from kvjax.config import ModelConfig


def real_length(io: LayerIO) -> Int[Array, "B"]:
    """Prompt tokens of each element (its padding excluded)."""
    return jnp.sum(io.valid[:, 0], axis=-1, dtype=jnp.int32)


def tail_mask(valid_BT: Bool[Array, "B T"], w: int) -> Bool[Array, "B T"]:
    """The last `w` columns (the window: the last w prompt tokens under left padding)."""
    T = valid_BT.shape[1]
    return jnp.broadcast_to(jnp.arange(T) >= T - w, valid_BT.shape) & valid_BT


def force(s_BKT: Array, forced_BT: Bool[Array, "B T"], valid_BT: Bool[Array, "B T"]):
    """Scores with the forced columns at +inf and padding at -inf."""
    s = jnp.where(forced_BT[:, None, :], jnp.inf, s_BKT)
    return jnp.where(valid_BT[:, None, :], s, -jnp.inf)


class HeadBudgets(NamedTuple):
    """How many entries each head of a layer keeps, and what the count was decided with."""

    count: Int[Array, "B K"]
    # entries that must join a selection rule's first stage (AdaKV's safeguard)
    first: Bool[Array, "B K T"] | None = None
    # the keep mask the method computed with the counts, when it did (AdaKV's flattened
    # top-k): its own selection uses it as is
    keep: Bool[Array, "B K T"] | None = None


# (io or None, scores [B, K, T] (forced +inf, padding -inf), budgets, slots S) ->
# (idx [B, K, S], live [B, K, S]): the selection rule a wrapper may replace
Chooser = Callable[[Any, Array, HeadBudgets, int], tuple[Array, Array]]


def top_per_head(io, s_BKT, hb: HeadBudgets, S: int):
    """The default rule: every head keeps its `count` best-scoring entries."""
    if hb.keep is not None:
        return selection.slots_from_mask(hb.keep, S)
    return selection.slots_from_scores(s_BKT, hb.count, S)


@dataclasses.dataclass(frozen=True)
class PrefillEviction(Method):
    """Base: keep `budget` entries per (layer, KV head) after prefill, window included."""

    name: ClassVar[str] = "_prefill_eviction"
    positional: ClassVar[bool] = False
    forced_what: ClassVar[str] = "the observation window"
    budget: int = 128

    # ---- checks -----------------------------------------------------------------------

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if getattr(self, "window", 0) < 0:
            raise ValueError(f"window={self.window} must be >= 0")
        if self.forced >= n:  # no budget fits: say so rather than print an empty range
            raise ValueError(
                f"the {self.forced} always-kept entries ({self.forced_what}) leave nothing to "
                f"choose in a prompt of {n} tokens: they must be fewer than {n} "
                "(use `full` to keep everything)")
        if self.budget <= self.forced:
            raise ValueError(
                f"budget={self.budget} must be larger than the {self.forced} always-kept entries "
                f"({self.forced_what}); allowed: {self.forced} < budget <= prompt length {n}")
        if self.budget > n:
            raise ValueError(
                f"budget={self.budget} exceeds the prompt length {n}; allowed: "
                f"{self.forced} < budget <= {n} (use `full` to keep everything)")
        for field, allowed in (("pooling", POOLINGS), ("gqa", GQA_REDUCTIONS)):
            if hasattr(self, field) and getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r}; allowed: {allowed}")
        if hasattr(self, "kernel") and (self.kernel < 1 or self.kernel % 2 == 0):
            raise ValueError(f"kernel={self.kernel} must be a positive odd integer")

    @property
    def forced(self) -> int:
        """Entries every head keeps whatever the scores (window, sinks)."""
        return getattr(self, "window", 0)

    # ---- shapes -----------------------------------------------------------------------

    def kept_slots(self, n: int) -> int:
        return min(self.budget, n)

    # ---- the prefill hook -------------------------------------------------------------

    def scores(self, io: LayerIO) -> Float[Array, "B K T"]:
        """Per-KV-head scores of every prompt column; forced +inf, padding -inf."""
        raise NotImplementedError

    def head_count(self, io: LayerIO, state: Any) -> Int[Array, "B"]:
        """This layer's per-head budget for each element: `budget` (uniform) by default."""
        return jnp.full(io.k.shape[:1], self.budget, jnp.int32)

    def head_budgets(self, io: LayerIO, s_BKT: Array, state: Any) -> HeadBudgets:
        """How many entries each head keeps: the layer budget, at most the prompt."""
        B, K = s_BKT.shape[:2]
        count = jnp.minimum(self.head_count(io, state), real_length(io))[:, None]
        return HeadBudgets(jnp.broadcast_to(count, (B, K)))

    def choose(self, io, s_BKT, hb: HeadBudgets, S: int):
        """Which entries the heads keep given their budgets (`top_per_head`)."""
        return top_per_head(io, s_BKT, hb, S)

    def after_layer_prefill(self, io: LayerIO, state: Any):
        return self.evict_layer(io, state, self.choose)

    def evict_layer(self, io: LayerIO, state: Any, choose: Chooser):
        """The prefill hook with a given selection rule (a wrapper such as CriticalKV
        passes its own): scores, per-head budgets, the rule, compaction."""
        T = io.k.shape[2]
        if self.budget >= T:  # keeps everything (budget <= every prompt's length <= T)
            return io.kv, None, state
        s = self.scores(io)
        idx, live = choose(io, s, self.head_budgets(io, s, state), self.cache_slots(T, io.cfg))
        return selection.gather_kept(io.kv, idx, live, io.kernels.compact), None, state

    def next_position(self, kv: LayerKV, pos_BT, valid_BT):
        # positions are never renumbered, and the last prompt token may be evicted
        # (observed attention): the next token follows the last prompt column
        return pos_BT[:, -1] + 1

    def finalize(self, kv: LayerKV, aux, state):
        live = jnp.sum(kv.valid, axis=-1, dtype=jnp.int32)  # [L, B, K]
        return kv, state, {"layer_budgets": jnp.moveaxis(live, 1, 0)}  # [B, L, K]


@dataclasses.dataclass(frozen=True)
class WindowScored(PrefillEviction):
    """SnapKV's score: pooled window attention of the prefix, GQA-reduced; the window is
    forced. Shared by the SnapKV family (SnapKV, PyramidKV, AdaKV, HeadKV)."""

    name: ClassVar[str] = "_window_scored"
    budget: int = 128
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"

    def prefix_scores(self, io: LayerIO):
        """Pooled, group-reduced window scores of the prefix [B, K, T - window]."""
        return pallas.window_scores(io.q, io.k, io.valid_BT, window=self.window,
                                    kernel=self.kernel, pooling=self.pooling, gqa=self.gqa,
                                    reduce="mean", implementation=io.kernels.window_scores)

    def scores(self, io: LayerIO):
        valid = io.valid_BT
        s = jnp.pad(self.prefix_scores(io), [(0, 0), (0, 0), (0, self.window)])
        return force(s, tail_mask(valid, self.window), valid)


@dataclasses.dataclass(frozen=True)
class DecodeEviction(PrefillEviction):
    """Also evicts while decoding: exactly `budget` live entries per (layer, head) after
    every step (and after a context-only question chunk)."""

    name: ClassVar[str] = "_decode_eviction"

    def decode_capacity(self, kept: int, question: int, max_new: int) -> int:
        return kept + max(question, 1 if max_new else 0)

    def decode_slots(self, cache, state, T: int):
        return selection.free_slots(cache.valid, T)

    def decode_scores(self, io: LayerIO, probs: Array, state: Any
                      ) -> tuple[Float[Array, "B K C"], Bool[Array, "B K C"], Any]:
        """(per-slot scores, which slots may go, state); `probs` [B, K, G, T, C]."""
        raise NotImplementedError

    def decode_layer(self, io: LayerIO, probs: Array, state: Any):
        s, evictable, state = self.decode_scores(io, probs, state)
        live = jnp.sum(io.valid, axis=-1, dtype=jnp.int32)  # [B, K]
        excess = jnp.maximum(live - self.budget, 0)
        gone = selection.evict_lowest(s, evictable & io.valid, excess, io.q.shape[1])
        state = self.on_evict(gone, io, state)
        return LayerKV(io.k, io.v, io.pos, io.valid & ~gone), state

    def on_evict(self, gone_BKC, io: LayerIO, state: Any) -> Any:
        """State after `gone` slots were evicted (H2O, RoCo reset their per-slot scores)."""
        return state


def newest_positions(io: LayerIO, r: int) -> Bool[Array, "B K C"]:
    """Live slots holding one of the `r` most recent positions of their head."""
    top = jnp.max(jnp.where(io.valid, io.pos, -1), axis=-1, keepdims=True)
    return io.valid & (io.pos > top - r)


def query_sum(probs: Array, qvalid_BT: Array | None, last: bool = False):
    """Sum over the valid queries of probs [B,K,G,T,C] (or only the last query)."""
    if last:
        return probs[:, :, :, -1]
    if qvalid_BT is None:
        return jnp.sum(probs, axis=3)
    return jnp.sum(jnp.where(qvalid_BT[:, None, None, :, None], probs, 0.0), axis=3)
