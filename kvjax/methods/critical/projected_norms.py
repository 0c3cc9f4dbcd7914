"""CriticalKV (Feng et al. 2025, "Identify critical KV cache in LLM inference from an
output perturbation perspective"): the projected value norm and the two-stage rule.

- `projected_value_norms`: `||V_i W_O^h||_1` for every prompt entry i and query head h
  (W_O^h = rows h*Dh:(h+1)*Dh of the layer's W_O [H*Dh, D]), averaged over the G query
  heads sharing each KV head (kvpress `CriticalKVPress.vwl1norm`). Computed in blocks
  of `block` tokens (`lax.map`), so at most [B, H, block, D] exists at once, never
  [B, H, n, D]: the `value_norms` kernel op's `xla` reference.
- `two_stage_scores`: Algorithm 1 of the paper / kvpress semantics. Per head with budget
  b: stage 1 keeps the top `int(alpha * b)` entries by the base attention score; stage 2
  ranks the others by `(score + eps) * norm`. Returned as one score array whose top-b
  per head is the two-stage kept set (stage-1 and `extra` entries at +inf).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.compression.selection import mark
from kvjax.pallas.ops.value_norms import xla as value_norms_xla

EPS = 1e-4
ALPHA = 0.5


def projected_value_norms(
    v_BKTD: Float[Array, "B K T Dh"], wo: Float[Array, "HDh D"], block: int = 256
) -> Float[Array, "B K T"]:
    """mean_g ||v_i W_O^{k*G+g}||_1 per KV head k and entry i, blockwise over tokens: the
    `value_norms` kernel op's reference (`kvjax.pallas.ops.value_norms.xla`)."""
    return value_norms_xla.value_norms(v_BKTD, wo, block=block)


def projected_value_norms_dense(v_BKTD, wo):
    """The materialising form ([B, H, T, D] at once), for tests and the speed note."""
    B, K, T, Dh = v_BKTD.shape
    w = wo.reshape(K, -1, Dh, wo.shape[-1]).astype(jnp.float32)
    y = jnp.einsum("bktd,kgde->bkgte", v_BKTD.astype(jnp.float32), w,
                   precision=jax.lax.Precision.HIGHEST)
    return jnp.mean(jnp.sum(jnp.abs(y), axis=-1), axis=2)


def top_mask(s_BKT: Float[Array, "B K T"], count_BK: Int[Array, "B K"], k_max: int
             ) -> Bool[Array, "B K T"]:
    """The top `count` entries of every head (count <= k_max, static)."""
    k_max = max(1, min(k_max, s_BKT.shape[-1]))
    _, top = jax.lax.top_k(s_BKT, k_max)  # lower index first on ties
    return mark(s_BKT.shape, top, jnp.arange(k_max) < count_BK[..., None])


def stage1_count(b_BK: Int[Array, "B K"], alpha: float) -> Int[Array, "B K"]:
    """int(alpha * b), at least 1 when alpha > 0 and b > 0 (kvpress's floor)."""
    c = jnp.floor(b_BK.astype(jnp.float32) * alpha).astype(jnp.int32)
    if alpha > 0:
        c = jnp.where(b_BK > 0, jnp.maximum(c, 1), 0)
    return c


def two_stage_scores(
    s_BKT: Float[Array, "B K T"],
    norm_BKT: Float[Array, "B K T"],
    b_BK: Int[Array, "B K"],
    k_max: int,
    alpha: float = ALPHA,
    eps: float = EPS,
    extra_BKT: Bool[Array, "B K T"] | None = None,
) -> Float[Array, "B K T"]:
    """Scores whose top `b` per head is CriticalKV's kept set.

    `s` is the base score with forced entries (window) at +inf and padding at -inf;
    stage 1 = the top `int(alpha * b)` of `s` (plus `extra`, e.g. AdaKV's safeguard) at
    +inf; every other valid entry scores `(s + eps) * norm`; padding stays -inf.
    """
    first = top_mask(s_BKT, stage1_count(b_BK, alpha), k_max)
    if extra_BKT is not None:
        first = first | extra_BKT
    second = (jnp.where(jnp.isfinite(s_BKT), s_BKT, 0.0) + eps) * norm_BKT
    out = jnp.where(first | (s_BKT == jnp.inf), jnp.inf, second)
    return jnp.where(s_BKT == -jnp.inf, -jnp.inf, out)
