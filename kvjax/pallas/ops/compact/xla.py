"""The reference: `kvjax.compression.cache.take_slots` at the kept indices; dead slots are zeros."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.compression.cache import take_slots


def live_slots(count_BK: Int[Array, "B K"], S: int) -> Bool[Array, "B K S"]:
    return jnp.arange(S) < count_BK[..., None]


def compact(
    k_BKTD: Float[Array, "B K T D"],
    v_BKTD: Float[Array, "B K T D"],
    pos_BKT: Int[Array, "B K T"],
    idx_BKS: Int[Array, "B K S"],
    count_BK: Int[Array, "B K"],
):
    """-> (k, v [B, K, S, D], pos, valid [B, K, S]): slot s of a head holds row idx[s] if
    s < count, else zeros (dead rows must be finite: attention multiplies them by 0)."""
    valid = live_slots(count_BK, idx_BKS.shape[-1])
    keep = lambda x: jnp.where(valid[..., None] if x.ndim == 4 else valid, take_slots(x, idx_BKS), 0)
    return keep(k_BKTD), keep(v_BKTD), keep(pos_BKT), valid
