"""The reference: `take_slots` (the gather `kvjax.compression` uses too) at the kept indices;
dead slots are zeros."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def take_slots(x_BKC: Array, idx_BKS: Int[Array, "B K S"]) -> Array:
    """Rows of a per-(batch, head) slot axis at the given indices (axis 2)."""
    if x_BKC.ndim == 4:
        return jnp.take_along_axis(x_BKC, idx_BKS[..., None], axis=2)
    return jnp.take_along_axis(x_BKC, idx_BKS, axis=2)


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
