"""Which KV heads a hook sees: all of them, or one device's block of them inside the
engine's `shard_map` over a mesh axis (docs/design.md, "Multi-device").

With the KV heads split over a mesh axis, each device scores and selects for its own
heads: a method's per-head work (window scores, a per-head top-k, compaction) is the same
code on a block of heads. What spans heads goes through `Heads`: a sum over heads (LAVa's
entropy, CAKE's preference), a head's global index, and the flattened top-k over heads x
positions (AdaKV, LAVa). `Heads()` (no axis, the default and the only case without a mesh)
runs the plain single-device operation: no collective, no extra work. Inside the
shard_map, `Heads(axis)` runs the collective form, which keeps exactly the entries the
single-device one keeps, ties included (lower flat index first, as `lax.top_k`):

- `flat_top_mask`: each device takes its own top `k` candidates (the global top `k` lies
  in their union), the devices all-gather them (values only: a device's block precedes the
  next one's in flat order) and each marks its entries among the first `total` of one
  top-k over the gathered candidates;
- `flat_rank`: the same with every entry that has a finite key as a candidate; the rest
  are ranked by flat index after them, from per-device counts.

Sums over heads (`sum`, `mean`) are `psum`s: the same numbers added in another order, so
a float that lands within rounding of a boundary (a layer's share of LAVa's budget at a
largest-remainder tie) may round the other way; integer counts and the top-k are exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

_BIG = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True)
class Heads:
    """The KV heads of a `LayerIO`: all of them (`axis` None) or a block of a mesh axis.

    Static (a field of `LayerIO`'s metadata): set by the engine inside its shard_map
    (`kvjax.distributed.shard_heads`), never by a method."""

    axis: str | None = None

    @property
    def split(self) -> bool:
        return self.axis is not None

    def blocks(self) -> int:
        """How many blocks the heads are split into (devices on the axis)."""
        return jax.lax.axis_size(self.axis) if self.split else 1

    def total(self, local: int) -> int:
        """The model's KV heads (or query heads) given this block's count."""
        return local * self.blocks()

    def offset(self, local: int):
        """The global index of this block's first head (0 unsplit)."""
        return jax.lax.axis_index(self.axis) * local if self.split else 0

    def sum(self, x: Array) -> Array:
        """x summed over the blocks (x already summed over this block's heads)."""
        return jax.lax.psum(x, self.axis) if self.split else x

    def mean(self, x: Array, axis) -> Array:
        """`jnp.mean(x, axis)` where `axis` includes the head axis."""
        if not self.split:
            return jnp.mean(x, axis=axis)
        n = 1
        for a in (axis if isinstance(axis, tuple) else (axis,)):
            n *= x.shape[a]
        return self.sum(jnp.sum(x, axis=axis)) / (n * self.blocks())

    def gather(self, x: Array, axis: int) -> Array:
        """Every block's x concatenated along `axis`, in block order."""
        return jax.lax.all_gather(x, self.axis, axis=axis, tiled=True) if self.split else x

    def mine(self, x: Array, size: int, axis: int = 1) -> Array:
        """This block's `size` entries of a gathered array (`gather`'s inverse)."""
        if not self.split:
            return x
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.axis) * size, size,
                                            axis=axis)


def flat_top_mask(scores_BKn: Float[Array, "B K n"], total_B: Int[Array, "B"], k_max: int,
                  heads: Heads = Heads()) -> Bool[Array, "B K n"]:
    """The top `total` (<= k_max, static) entries over all heads x positions (ties: lower
    flat index first, as `lax.top_k`) as a keep mask of this block's heads."""
    B, K, n = scores_BKn.shape
    b = jnp.arange(B)[:, None]
    take = jnp.arange(k_max)[None, :] < total_B[:, None]
    if not heads.split:
        _, flat = jax.lax.top_k(scores_BKn.reshape(B, K * n), k_max)
        keep = jnp.zeros((B, K * n), bool).at[b, flat].set(take)
        return keep.reshape(B, K, n)
    kl = min(k_max, K * n)  # a device's entries among the global top k_max are its top kl
    vals, idx = jax.lax.top_k(scores_BKn.reshape(B, K * n), kl)
    every = heads.gather(vals, 1)  # [B, M * kl]: block order is flat order on ties
    _, order = jax.lax.top_k(every, k_max)
    chosen = jnp.zeros(every.shape, bool).at[b, order].set(take)
    keep = jnp.zeros((B, K * n), bool).at[b, idx].set(heads.mine(chosen, kl))
    return keep.reshape(B, K, n)


def flat_rank(s_BKP: Float[Array, "B K P"], eligible_BKP: Bool[Array, "B K P"] | None,
              heads: Heads, per_head: int | None = None) -> Int[Array, "B K P"]:
    """The rank (best 0) of this block's entries in one order over every head x position:
    by score where `eligible` and the score is above -inf, ties lower flat index first;
    then every other entry, by flat index (the stable argsort of `-s`, +inf where not
    eligible, that `kvjax.methods.lava.cascade.flat_rank` computes on one device).
    `per_head` (static): at most this many eligible entries per head (LAVa's head cap),
    which bounds the candidates each device gathers."""
    B, K, P = s_BKP.shape
    b = jnp.arange(B)[:, None]
    ranked = s_BKP > -jnp.inf
    if eligible_BKP is not None:
        ranked = ranked & eligible_BKP
    ranked = ranked.reshape(B, K * P)
    c = K * min(P, per_head or P)
    vals, idx = jax.lax.top_k(jnp.where(ranked, s_BKP.reshape(B, K * P), -jnp.inf), c)
    every = heads.gather(vals, 1)  # [B, M * c]
    _, order = jax.lax.top_k(every, every.shape[1])  # the whole order of the candidates
    pos_rank = jnp.zeros(every.shape, jnp.int32).at[b, order].set(
        jnp.broadcast_to(jnp.arange(every.shape[1], dtype=jnp.int32), every.shape))
    rank = jnp.zeros((B, K * P), jnp.int32).at[b, idx].set(heads.mine(pos_rank, c))
    rest = ~ranked
    n_ranked = heads.sum(jnp.sum(ranked, axis=1, dtype=jnp.int32))  # [B]
    rest_per_block = heads.gather(jnp.sum(rest, axis=1, dtype=jnp.int32)[:, None], 1)
    me = jax.lax.axis_index(heads.axis) if heads.split else 0
    before = jnp.sum(jnp.where(jnp.arange(rest_per_block.shape[1]) < me, rest_per_block, 0),
                     axis=1)
    rest_rank = (n_ranked + before)[:, None] + jnp.cumsum(rest, axis=1, dtype=jnp.int32) - 1
    return jnp.where(ranked, rank, rest_rank).reshape(B, K, P)
