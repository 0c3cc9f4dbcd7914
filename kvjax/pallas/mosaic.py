"""Mosaic TPU helpers shared by the TPU kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot(a, b, contract: tuple[int, int], interpret: bool = False):
    """a . b contracting a's axis contract[0] with b's contract[1], fp32 accumulation.

    fp32 operands get full precision on the MXU. Interpreted on CPU, 16-bit operands are
    widened first: XLA:CPU has no bf16 x bf16 -> f32 dot for every shape, and widening is
    exact (bf16 products are exact in fp32), so the result is the device's.
    """
    if interpret and a.dtype != jnp.float32:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               precision=prec, preferred_element_type=jnp.float32)
