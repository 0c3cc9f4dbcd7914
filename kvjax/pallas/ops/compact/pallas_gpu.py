"""Mosaic GPU compaction: a gather kernel, one warpgroup per (head, row tile).

Each kept row is read from GMEM into registers and stored at its slot (zeros for dead
slots); the warpgroup's 128 threads read one row's D values side by side, so every row
is one coalesced read. Positions are gathered by XLA, as on TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from kvjax.pallas import mgpu
from kvjax.pallas.ops.compact import xla


def reason(k_BKTD, rows: int) -> str | None:
    D = k_BKTD.shape[-1]
    if D % 128:
        return f"head dim {D} must be a multiple of 128 (one element per thread)"
    return None


def _body(idx_g, count_g, k_g, v_g, ko_g, vo_g, *, rows, S):
    n, t = lax.axis_index("n"), lax.axis_index("tile")
    count = jnp.minimum(count_g[n], S)

    def row(r, carry):
        s = t * rows + r

        # live and dead slots in two branches, not one select: Mosaic GPU's warpgroup
        # lowering (jax >= 0.11) has no select of a row by a scalar predicate
        @pl.when(s < count)
        def _():
            i = idx_g[n, s]
            for src, dst in ((k_g, ko_g), (v_g, vo_g)):
                dst[n, pl.ds(s, 1), :] = src[n, pl.ds(i, 1), :]

        @pl.when((s >= count) & (s < S))
        def _():
            for dst in (ko_g, vo_g):
                dst[n, pl.ds(s, 1), :] = jnp.zeros((1, dst.shape[-1]), dst.dtype)

        return carry

    lax.fori_loop(0, rows, row, 0)


@functools.partial(jax.jit, static_argnames=("rows", "interpret"))
def compact(
    k_BKTD: Float[Array, "B K T D"],
    v_BKTD: Float[Array, "B K T D"],
    pos_BKT: Int[Array, "B K T"],
    idx_BKS: Int[Array, "B K S"],
    count_BK: Int[Array, "B K"],
    *,
    rows: int = 32,
    interpret: bool = False,
):
    B, K, T, D = k_BKTD.shape
    S = idx_BKS.shape[-1]
    N = B * K
    out = jax.ShapeDtypeStruct((N, S, D), k_BKTD.dtype)
    with mgpu.tracing(interpret):
        k, v = plgpu.kernel(
            functools.partial(_body, rows=rows, S=S),
            out_type=(out, out),
            grid=(N, pl.cdiv(S, rows)), grid_names=("n", "tile"),
            interpret=mgpu.interpret_params(interpret),
        )(idx_BKS.reshape(N, S).astype(jnp.int32), count_BK.reshape(N).astype(jnp.int32),
          k_BKTD.reshape(N, T, D), v_BKTD.reshape(N, T, D))
    valid = xla.live_slots(count_BK, S)
    pos = jnp.where(valid, jnp.take_along_axis(pos_BKT, idx_BKS, axis=2), 0)
    return k.reshape(B, K, S, D), v.reshape(B, K, S, D), pos, valid
