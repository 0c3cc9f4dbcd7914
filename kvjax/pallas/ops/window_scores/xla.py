"""The reference: `kvjax.compression.scoring.snap_scores` (pure jnp, holds [B, H, window, T])."""

from __future__ import annotations

from jaxtyping import Array, Bool, Float

from kvjax.compression import scoring


def window_scores(
    q_BTHD: Float[Array, "B T H D"],
    k_BKTD: Float[Array, "B K T D"],
    valid_BT: Bool[Array, "B T"],
    *,
    window: int,
    kernel: int,
    pooling: str,
    gqa: str,
    reduce: str,
) -> Float[Array, "B K P"]:
    return scoring.snap_scores(q_BTHD, k_BKTD, valid_BT, window, kernel, pooling, gqa, reduce)
