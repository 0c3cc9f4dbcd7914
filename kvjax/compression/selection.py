"""Selection and compaction into the fixed-shape cache (docs/design.md, "The cache").

A layer's prompt KV [B, K, n, D] becomes S static slots per (batch element, KV head):
the kept entries first, ascending by position, then dead slots (`valid` False). Counts
differ per head and element (AdaKV, PyramidKV under padding); shapes do not.

Selection is `lax.top_k` (ties: lower index first). Forced entries (window, sinks) score
+inf and padding -inf before they get here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax import pallas
from kvjax.compression.cache import LayerKV, take_slots


def slots_from_scores(
    scores_BKn: Float[Array, "B K n"], count_BK: Int[Array, "B K"], S: int
) -> tuple[Int[Array, "B K S"], Bool[Array, "B K S"]]:
    """The top `count` entries of every head (count <= S), as ascending indices into n.

    Returns (idx, live): idx[..., j] for j < count are the kept positions in ascending
    order; the rest point at arbitrary unkept entries and are not live.
    """
    n = scores_BKn.shape[-1]
    S = min(S, n)
    _, top = jax.lax.top_k(scores_BKn, S)  # [B, K, S], best first
    live = jnp.arange(S) < count_BK[..., None]
    key = jnp.sort(jnp.where(live, top, top + n), axis=-1)  # kept ascending, then the rest
    live = key < n
    return jnp.where(live, key, key - n), live


def slots_from_mask(keep_BKn: Bool[Array, "B K n"], S: int
                    ) -> tuple[Int[Array, "B K S"], Bool[Array, "B K S"]]:
    """The entries marked in `keep` (at most S per head), ascending, then dead slots."""
    n = keep_BKn.shape[-1]
    S = min(S, n)
    i = jnp.arange(n, dtype=jnp.int32)
    _, idx = jax.lax.top_k(jnp.where(keep_BKn, n - i, -i), S)  # kept first, ascending
    live = jnp.take_along_axis(keep_BKn, idx, axis=-1)
    return idx, live


def gather_kept(kv: LayerKV, idx_BKS: Int[Array, "B K S"], live_BKS: Bool[Array, "B K S"],
            implementation: str | None = None) -> LayerKV:
    """One layer's (k, v, pos, valid) [B, K, n, ...] gathered into S slots by the `compact`
    op (its backend chosen there; dead slots zeros); `valid` = live & was valid. `live` is
    a prefix of the slots, as `slots_from_scores` and `slots_from_mask` give it."""
    count = jnp.sum(live_BKS, axis=-1, dtype=jnp.int32)
    k, v, pos, live = pallas.compact(kv.k, kv.v, kv.pos, idx_BKS, count,
                                     implementation=implementation)
    return LayerKV(k, v, pos, live & take_slots(kv.valid, idx_BKS))


def mark(shape: tuple, idx_BKE: Int[Array, "B K E"], value_BKE: Array,
         reduce: str = "set") -> Array:
    """A [B, K, C] array of zeros with entries idx (per batch element and head) set to
    `value` (`reduce="max"`: the largest value written wins)."""
    B, K = idx_BKE.shape[:2]
    at = jnp.zeros(shape, value_BKE.dtype).at[
        jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], idx_BKE]
    return at.max(value_BKE) if reduce == "max" else at.set(value_BKE)


def evict_lowest(
    scores_BKC: Float[Array, "B K C"],
    evictable_BKC: Bool[Array, "B K C"],
    excess_BK: Int[Array, "B K"],
    max_evict: int,
) -> Bool[Array, "B K C"]:
    """Mark the `excess` (<= max_evict, static) lowest-scoring evictable slots of each head.

    Ties: the lower slot index goes first. Decode-time eviction calls this once per layer
    and step with max_evict = number of new tokens.
    """
    C = scores_BKC.shape[-1]
    s = jnp.where(evictable_BKC, -scores_BKC, -jnp.inf)
    if max_evict == 1:
        idx = jnp.argmax(s, axis=-1)[..., None]  # first maximum: lowest slot on ties
    else:
        idx = jax.lax.top_k(s, min(max_evict, C))[1]
    take = (jnp.arange(idx.shape[-1]) < excess_BK[..., None]) & jnp.take_along_axis(
        evictable_BKC, idx, axis=-1)
    return mark(scores_BKC.shape, idx, take)


def top_with_window(s_P: Float[Array, "P"], k: int, window: int) -> Int[Array, "k"]:
    """Indices (ascending) of the top `k - window` prefix entries plus the window (the
    `window` columns after the P prefix columns)."""
    P = s_P.shape[0]
    top = jax.lax.top_k(s_P, k - window)[1]
    return jnp.sort(jnp.concatenate([top, jnp.arange(P, P + window)]))


def free_slots(valid_LBKC: Bool[Array, "L B K C"], T: int) -> Int[Array, "L B K T"]:
    """The first T dead slots of every (layer, element, head), lowest first."""
    if T == 1:
        return jnp.argmin(valid_LBKC, axis=-1)[..., None].astype(jnp.int32)
    return jnp.argsort(valid_LBKC, axis=-1, stable=True)[..., :T].astype(jnp.int32)
