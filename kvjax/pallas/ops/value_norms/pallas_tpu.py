"""Mosaic TPU projected value norms: V tiles against the head's W_O slices, in VMEM.

Grid (B*K, token tiles, hidden tiles). A step multiplies the W_O^h tile of each of the
G query heads [hidden tile, Dh] by the V tile [tokens, Dh]^T, so the product comes out
[hidden tile, tokens] and its L1 norm is a reduction over sublanes into a lane-major
[1, tokens] row, accumulated over heads and hidden tiles in the resident output block.
`V W_O` never leaves VMEM. W_O is transposed once per call in XLA (weights, not cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from kvjax.pallas import mosaic

WEIGHT_VMEM = 4 << 20  # bytes of W_O (all G heads) a step may hold


def reason(v_BKTD, o_HDM, tile: int) -> str | None:
    if tile % 128:
        return f"tile={tile} must be a multiple of 128"
    return None


def hidden_tile(G: int, Dh: int, M: int, itemsize: int) -> int:
    """The largest of 2048, 1024, ..., 128 dividing M whose weights fit WEIGHT_VMEM, else M."""
    for m in (2048, 1024, 512, 256, 128):
        if M % m == 0 and (G * Dh * m * itemsize <= WEIGHT_VMEM or m == 128):
            return m
    return M


def _kernel(v_ref, w_ref, o_ref, *, G, interpret):
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)

    v = v_ref[...]
    acc = o_ref[...]
    for g in range(G):
        y = mosaic.dot(w_ref[g], v, (1, 1), interpret)  # [m, tile]
        acc = acc + jnp.sum(jnp.abs(y), axis=0, keepdims=True) / G
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def value_norms(
    v_BKTD: Float[Array, "B K T Dh"],
    o_HDM: Float[Array, "HDh M"],
    *,
    tile: int = 512,
    interpret: bool = False,
) -> Float[Array, "B K T"]:
    B, K, T, Dh = v_BKTD.shape
    M = o_HDM.shape[1]
    H = o_HDM.shape[0] // Dh
    G, N = H // K, B * K
    dt = jnp.promote_types(v_BKTD.dtype, o_HDM.dtype)  # as the reference's einsum
    v = v_BKTD.astype(dt).reshape(N, T, Dh)
    w = o_HDM.astype(dt).reshape(K, G, Dh, M).transpose(0, 1, 3, 2)  # [K, G, M, Dh]
    m = hidden_tile(G, Dh, M, w.dtype.itemsize)
    out = pl.pallas_call(
        functools.partial(_kernel, G=G, interpret=bool(interpret)),
        grid=(N, pl.cdiv(T, tile), M // m),
        in_specs=[pl.BlockSpec((None, tile, Dh), lambda n, t, j: (n, t, 0)),
                  pl.BlockSpec((None, G, m, Dh), lambda n, t, j: (n % K, 0, j, 0))],
        out_specs=pl.BlockSpec((None, 1, tile), lambda n, t, j: (n, 0, t)),
        out_shape=jax.ShapeDtypeStruct((N, 1, T), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="value_norms",
    )(v, w)
    return out.reshape(B, K, T)
