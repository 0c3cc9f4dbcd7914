"""Mosaic TPU compaction: a DMA per kept row, indices and counts scalar-prefetched.

Grid (B*K, row tiles). A step reads its tile's source indices from SMEM and issues one
HBM-to-HBM DMA per live row (K and V), then waits for all of them; dead rows of a tile
get zeros by DMA from a zeroed VMEM tile, a fully dead tile moves nothing else. The
positions are one int32 per row: XLA gathers them (1/(2 D) of the bytes). Indices of the
whole call sit in SMEM, so very large B * K * S falls back to xla (`reason`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kvjax.pallas.ops.compact import xla

MAX_INDICES = 1 << 16  # 256 KiB of SMEM


def reason(idx_BKS, rows: int) -> str | None:
    if idx_BKS.size > MAX_INDICES:
        return f"{idx_BKS.size} indices exceed the {MAX_INDICES} that fit in SMEM"
    if rows % 8:
        return f"rows={rows} must be a multiple of 8"
    return None


def _kernel(idx_ref, count_ref, k_hbm, v_hbm, ko_hbm, vo_hbm, zeros, sem, *, rows, S):
    n, t = pl.program_id(0), pl.program_id(1)
    count = jnp.minimum(count_ref[n], S)
    zeros[...] = jnp.zeros(zeros.shape, zeros.dtype)

    def copies(r):
        """(live?, dead?, the DMAs of slot t*rows + r) for K and V."""
        s = t * rows + r
        i = idx_ref[n * S + jnp.minimum(s, S - 1)]
        out = []
        for src, dst in ((k_hbm, ko_hbm), (v_hbm, vo_hbm)):
            out.append(pltpu.make_async_copy(src.at[n, pl.ds(i, 1)], dst.at[n, pl.ds(s, 1)],
                                             sem.at[0]))
            out.append(pltpu.make_async_copy(zeros.at[pl.ds(r, 1)], dst.at[n, pl.ds(s, 1)],
                                             sem.at[1]))
        return s < count, (s < S) & (s >= count), out

    def run(method):
        def body(r, carry):
            live, dead, (take_k, zero_k, take_v, zero_v) = copies(r)
            for c in (take_k, take_v):
                pl.when(live)(getattr(c, method))
            for c in (zero_k, zero_v):
                pl.when(dead)(getattr(c, method))
            return carry
        jax.lax.fori_loop(0, rows, body, 0)

    run("start")  # every copy of the tile in flight at once ...
    run("wait")  # ... then drained


@functools.partial(jax.jit, static_argnames=("rows", "interpret"))
def compact(
    k_BKTD: Float[Array, "B K T D"],
    v_BKTD: Float[Array, "B K T D"],
    pos_BKT: Int[Array, "B K T"],
    idx_BKS: Int[Array, "B K S"],
    count_BK: Int[Array, "B K"],
    *,
    rows: int = 16,
    interpret: bool = False,
):
    B, K, T, D = k_BKTD.shape
    S = idx_BKS.shape[-1]
    N = B * K
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(N, pl.cdiv(S, rows)),
        in_specs=[any_spec, any_spec],
        out_specs=[any_spec, any_spec],
        scratch_shapes=[pltpu.VMEM((rows, D), k_BKTD.dtype), pltpu.SemaphoreType.DMA((2,))],
    )
    out = jax.ShapeDtypeStruct((N, S, D), k_BKTD.dtype)
    k, v = pl.pallas_call(
        functools.partial(_kernel, rows=rows, S=S),
        grid_spec=grid_spec,
        out_shape=[out, out],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="compact",
    )(idx_BKS.reshape(-1).astype(jnp.int32), count_BK.reshape(-1).astype(jnp.int32),
      k_BKTD.reshape(N, T, D), v_BKTD.reshape(N, T, D))
    valid = xla.live_slots(count_BK, S)
    pos = jnp.where(valid, jnp.take_along_axis(pos_BKT, idx_BKS, axis=2), 0)
    return k.reshape(B, K, S, D), v.reshape(B, K, S, D), pos, valid
