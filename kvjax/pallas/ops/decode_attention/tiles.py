"""Which cache tiles hold a live slot, computed in XLA before the kernels run.

Reading the [B, K, S] mask costs 1/(2D) of reading K and V; knowing the live tiles lets
the kernels skip the DMA and the math of every dead tile (after compaction a head keeps
its entries at the front and the decoded tokens at `end`: the tiles in between and after
`end` are dead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def live_tiles(ok_NS: Bool[Array, "N S"], tile: int) -> Bool[Array, "N nt"]:
    N, S = ok_NS.shape
    nt = -(-S // tile)
    ok = jnp.pad(ok_NS, [(0, 0), (0, nt * tile - S)])
    return jnp.any(ok.reshape(N, nt, tile), axis=-1)


def fetch_order(live_Nt: Bool[Array, "N nt"], per: int) -> Int[Array, "N nt"]:
    """The tile each step of a split of `per` tiles fetches: a live tile itself, a dead one
    the last live tile before it in its split (else the split's first tile), so that the
    Mosaic TPU pipeline, which skips a copy whose block index did not change, moves
    nothing for a dead tile."""
    j = jnp.arange(live_Nt.shape[1])
    start = (j // per) * per
    return jax.lax.cummax(jnp.where(live_Nt, j, start), axis=1).astype(jnp.int32)


def live_order(live_Nt: Bool[Array, "N nt"]) -> tuple[Int[Array, "N nt"], Int[Array, "N"]]:
    """Live tiles first (ascending), then the dead ones; and how many are live. The GPU
    kernel loops over the live ones only."""
    order = jnp.argsort(~live_Nt, axis=1, stable=True).astype(jnp.int32)
    return order, jnp.sum(live_Nt, axis=1, dtype=jnp.int32)
