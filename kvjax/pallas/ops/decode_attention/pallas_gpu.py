"""Mosaic GPU decode attention: one warpgroup per (KV head, split), WGMMA on 64 rows.

The G query heads of a KV head are padded to the 64 rows a WGMMA multiplies (decode is
bound by reading K and V, so the idle rows cost tensor-core time, not bandwidth). Only
live tiles are visited: XLA lists them first (`tiles.live_order`), each block takes its
share of that list, and `emit_pipeline` streams K, V and mask tiles through SMEM with
TMA, its grid being the (dynamic) number of live tiles of the block. A ragged last tile
relies on TMA's zero fill on the device; the interpreter, which rejects out-of-bounds
copies, gets K and V padded to a whole tile instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Bool, Float

from kvjax.pallas import mgpu
from kvjax.pallas.ops.decode_attention import combine, tiles

R = mgpu.ROWS


def reason(q_BHD, k_BKSD, tile: int) -> str | None:
    G = q_BHD.shape[1] // k_BKSD.shape[1]
    D = q_BHD.shape[2]
    if k_BKSD.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {k_BKSD.dtype}: P @ V needs a 16-bit V (tf32 WGMMA takes no N-major B)"
    if G > R:
        return f"{G} query heads per KV head (at most {R})"
    if (D * k_BKSD.dtype.itemsize) % 128 or tile % 64:
        return f"head dim {D} must fill 128-byte rows and tile={tile} be a multiple of 64"
    return None


def _body(q_g, k_g, v_g, ok_g, order_g, count_g, o_g, m_g, l_g, q_s, bar, *,
          per: int, tile: int, scale: float):
    n, sp = lax.axis_index("n"), lax.axis_index("split")
    D = q_s.shape[1]
    plgpu.copy_gmem_to_smem(q_g.at[n], q_s, bar)
    plgpu.barrier_wait(bar)
    count = count_g[n]
    start = jnp.minimum(sp * per, count)
    steps = jnp.minimum(start + per, count) - start

    def tile_of(t):
        return order_g[n, start + t]

    def step(_, k_s, v_s, ok_s, carry):
        acc, m, l = carry
        s = mgpu.dot_nt(q_s, k_s) * scale  # [R, tile]
        ok = mgpu.cast(ok_s[...], plgpu.Layout.WGMMA.reduce(0))
        s = jnp.where(lax.broadcast_in_dim(ok, s.shape, [1]) > 0, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = acc + mgpu.dot_nn(p.astype(v_s.dtype), v_s)
        return acc, m_new, l

    kv_spec = plgpu.BlockSpec((tile, D), lambda t: (tile_of(t), 0),
                              transforms=mgpu.swizzled(k_g.dtype))
    init = (mgpu.cast(jnp.zeros((R, D), jnp.float32), plgpu.Layout.WGMMA),
            mgpu.cast(jnp.full((R,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            mgpu.cast(jnp.zeros((R,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
    acc, m, l = plgpu.emit_pipeline(
        step, grid=(steps,),
        in_specs=[kv_spec, kv_spec, plgpu.BlockSpec((tile,), lambda t: (tile_of(t),))],
        max_concurrent_steps=2, init_carry=init,
    )(k_g.at[n], v_g.at[n], ok_g.at[n])

    def write(o_s, m_s, l_s):
        o_s[...] = acc
        m_s[...] = m
        l_s[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[n, sp])
        plgpu.copy_smem_to_gmem(m_s, m_g.at[n, sp])
        plgpu.copy_smem_to_gmem(l_s, l_g.at[n, sp])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((R, D), jnp.float32), plgpu.SMEM((R,), jnp.float32),
                  plgpu.SMEM((R,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("tile", "splits", "interpret"))
def decode_attention(
    q_BHD: Float[Array, "B H D"],
    k_BKSD: Float[Array, "B K S D"],
    v_BKSD: Float[Array, "B K S D"],
    ok_BKS: Bool[Array, "B K S"],
    *,
    tile: int = 128,
    splits: int = 16,
    interpret: bool = False,
) -> Float[Array, "B H D"]:
    B, H, D = q_BHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G, N = H // K, B * K
    nt = pl.cdiv(S, tile)
    splits = max(1, min(splits, nt))
    per = pl.cdiv(nt, splits)
    q = q_BHD.reshape(N, G, D).astype(k_BKSD.dtype)
    q = jnp.pad(q, [(0, 0), (0, R - G), (0, 0)])  # the G heads, then zero rows up to 64
    k, v = k_BKSD.reshape(N, S, D), v_BKSD.reshape(N, S, D)
    if interpret and S % tile:
        k, v = (jnp.pad(x, [(0, 0), (0, nt * tile - S), (0, 0)]) for x in (k, v))
    ok = jnp.pad(ok_BKS.reshape(N, S), [(0, 0), (0, nt * tile - S)])
    order, count = tiles.live_order(tiles.live_tiles(ok, tile))
    part = lambda *shape: jax.ShapeDtypeStruct((N, splits, *shape), jnp.float32)
    with mgpu.tracing(interpret):
        o, m, l = plgpu.kernel(
            functools.partial(_body, per=per, tile=tile, scale=D ** -0.5),
            out_type=(part(R, D), part(R), part(R)),
            grid=(N, splits), grid_names=("n", "split"),
            scratch_types=[plgpu.SMEM((R, D), q.dtype, transforms=mgpu.swizzled(q.dtype)),
                            plgpu.Barrier(num_arrivals=1)],
            interpret=mgpu.interpret_params(interpret),
        )(q, k, v, ok.astype(jnp.float32), order, count)
    out = combine.combine(o[:, :, :G], m[:, :, :G], l[:, :, :G])
    return out.reshape(B, H, D).astype(q_BHD.dtype)
