"""The reference, in jnp: token blocks of `block`, so [B, H, block, hidden] at most.

norm[b, k, i] = mean over the G query heads h of KV head k of ||V[b, k, i] W_O^h||_1, with
W_O^h = o[h*Dh:(h+1)*Dh] the head's slice of the output projection (rows of `o`, the
model's [H*Dh, hidden] weight; head h = k*G + g, repeat_kv order), exact products summed
in fp32 (docs/methods.md "CriticalKV", kvpress `CriticalKVPress.vwl1norm`); CriticalKV's
`projected_value_norms` is this function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def value_norms(
    v_BKTD: Float[Array, "B K T Dh"],
    o_HDM: Float[Array, "HDh M"],
    *,
    block: int = 256,
) -> Float[Array, "B K T"]:
    B, K, T, Dh = v_BKTD.shape
    H = o_HDM.shape[0] // Dh
    # Products of two 16-bit floats are exact in fp32, so 16-bit inputs multiply as they
    # are (tensor cores on GPU) with fp32 accumulation: the same sums as upcasting first,
    # which an fp32 matmul at HIGHEST precision would run without tensor cores (25x slower
    # than the Pallas kernel on an H100 at 128k). Wider inputs are upcast to fp32.
    dt = jnp.promote_types(v_BKTD.dtype, o_HDM.dtype)
    dt = dt if jnp.finfo(dt).bits <= 16 else jnp.float32
    w = o_HDM.reshape(K, H // K, Dh, -1).astype(dt)
    blk = min(block, T)
    nb = -(-T // blk)
    v = jnp.pad(v_BKTD.astype(dt), [(0, 0), (0, 0), (0, nb * blk - T), (0, 0)])
    v = jnp.moveaxis(v.reshape(B, K, nb, blk, Dh), 2, 0)  # [nb, B, K, blk, Dh]

    def one(vb):
        y = jnp.einsum("bktd,kgdm->bkgtm", vb, w, preferred_element_type=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST if dt == jnp.float32 else None)
        return jnp.mean(jnp.sum(jnp.abs(y), axis=-1), axis=2)

    out = jax.lax.map(one, v)  # [nb, B, K, blk]
    return jnp.moveaxis(out, 0, 2).reshape(B, K, nb * blk)[..., :T]
