"""Mosaic TPU decode attention: flash-decoding over cache tiles, dead tiles skipped.

Grid (B*K, splits, tiles per split): each (KV head, split) keeps an online softmax of its
G query heads in VMEM. The tile each step fetches is scalar-prefetched (`tiles.fetch_order`):
a dead tile repeats the previous block index, so the pipeline issues no DMA, and
`pl.when` skips its math. Partial results are merged by `combine` in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float

from kvjax.pallas import mosaic
from kvjax.pallas.ops.decode_attention import combine, tiles

LANES = 128


def reason(q_BHD, k_BKSD, tile: int) -> str | None:
    if tile % 128:
        return f"tile={tile} must be a multiple of 128"
    return None


def _kernel(fetch_ref, live_ref, q_ref, k_ref, v_ref, ok_ref, o_ref, m_ref, l_ref,
            m_sc, l_sc, acc_sc, *, per, nt, tile, S, scale, interpret):
    n, sp, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    j = sp * per + t

    @pl.when(t == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    live = (j < nt) & (live_ref[n * nt + jnp.minimum(j, nt - 1)] != 0)

    @pl.when(live)
    def _():
        s = mosaic.dot(q_ref[...], k_ref[...], (1, 1), interpret) * scale  # [G, tile]
        col = j * tile + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where((ok_ref[...] != 0) & (col < S), s, -jnp.inf)
        m_old = m_sc[...]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_old - m_safe)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        v = v_ref[...]
        row = j * tile + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where(row < S, v, jnp.zeros_like(v))  # the ragged last tile: no 0 * NaN
        pv = mosaic.dot(p.astype(v.dtype), v, (1, 0), interpret)
        acc_sc[...] = alpha * acc_sc[...] + pv

    @pl.when(t == per - 1)
    def _():
        o_ref[...] = acc_sc[...]
        m_ref[...] = jnp.broadcast_to(m_sc[...], m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_sc[...], l_ref.shape)


@functools.partial(jax.jit, static_argnames=("tile", "splits", "interpret"))
def decode_attention(
    q_BHD: Float[Array, "B H D"],
    k_BKSD: Float[Array, "B K S D"],
    v_BKSD: Float[Array, "B K S D"],
    ok_BKS: Bool[Array, "B K S"],
    *,
    tile: int = 512,
    splits: int = 2,
    interpret: bool = False,
) -> Float[Array, "B H D"]:
    B, H, D = q_BHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G, N = H // K, B * K
    nt = pl.cdiv(S, tile)
    splits = max(1, min(splits, nt))
    per = pl.cdiv(nt, splits)
    q = q_BHD.reshape(N, G, D)
    k = k_BKSD.reshape(N, S, D)
    v = v_BKSD.reshape(N, S, D)
    ok = ok_BKS.reshape(N, 1, S).astype(jnp.int32)
    live = tiles.live_tiles(ok_BKS.reshape(N, S), tile)
    fetch = tiles.fetch_order(live, per).reshape(-1)
    live = live.astype(jnp.int32).reshape(-1)

    def tile_of(n, sp, t, fetch_ref, live_ref):
        return fetch_ref[n * nt + jnp.minimum(sp * per + t, nt - 1)]

    kv_spec = pl.BlockSpec((None, tile, D),
                           lambda n, sp, t, f, lv: (n, tile_of(n, sp, t, f, lv), 0))
    row_spec = pl.BlockSpec((None, None, G, LANES), lambda n, sp, t, f, lv: (n, sp, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(N, splits, per),
        in_specs=[pl.BlockSpec((None, G, D), lambda n, sp, t, f, lv: (n, 0, 0)), kv_spec, kv_spec,
                  pl.BlockSpec((None, 1, tile),
                               lambda n, sp, t, f, lv: (n, 0, tile_of(n, sp, t, f, lv)))],
        out_specs=[pl.BlockSpec((None, None, G, D), lambda n, sp, t, f, lv: (n, sp, 0, 0)),
                   row_spec, row_spec],
        scratch_shapes=[pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32),
                        pltpu.VMEM((G, D), jnp.float32)],
    )
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, per=per, nt=nt, tile=tile, S=S, scale=D ** -0.5,
                          interpret=bool(interpret)),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((N, splits, G, D), jnp.float32),
                   jax.ShapeDtypeStruct((N, splits, G, LANES), jnp.float32),
                   jax.ShapeDtypeStruct((N, splits, G, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention",
    )(fetch, live, q, k, v, ok)
    out = combine.combine(o, m[..., 0], l[..., 0])
    return out.reshape(B, H, D).astype(q_BHD.dtype)
