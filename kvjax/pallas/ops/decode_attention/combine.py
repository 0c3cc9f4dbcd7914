"""The flash-decoding combine: merge per-split partial softmax results in XLA.

Each split of the cache length returns its unnormalised output `o` = sum_i e^(s_i - m) v_i,
its max `m` and its sum `l` = sum_i e^(s_i - m). Rescaling every split to the global max
gives the exact softmax; a head with no live slot anywhere (all `l` = 0) gives zeros.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float


def combine(
    o_NSGD: Float[Array, "N S G D"], m_NSG: Float[Array, "N S G"], l_NSG: Float[Array, "N S G"]
) -> Float[Array, "N G D"]:
    m = jnp.max(m_NSG, axis=1, keepdims=True)
    scale = jnp.where(l_NSG > 0, jnp.exp(m_NSG - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    z = jnp.sum(scale * l_NSG, axis=1)
    o = jnp.sum(scale[..., None] * o_NSGD, axis=1)
    return o / jnp.where(z > 0, z, 1.0)[..., None]
