"""Mosaic GPU window scores: row statistics, then per-head column scores, by WGMMA.

The window queries of a KV head (G heads x w queries = R rows, padded to a multiple of
64) are the WGMMA rows.
- Pass 1, grid (B*K, row blocks, splits of the key range): the online max and sum of each
  row over its split's key tiles (`emit_pipeline` streams K and the padding mask through
  SMEM); XLA merges the splits.
- Pass 2, grid (B*K, prefix tiles): one key tile per block against all R rows; the
  probabilities are summed over each head's w rows in registers (a masked reduction over
  the row axis), and only the [G, tile] column scores reach HBM.
Pooling and the GQA reduction of those [B, K, G, P] scores run in XLA (`epilogue`); the
TPU kernel fuses them, here they cost G fp32 values per column against 2 D key values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Bool, Float

from kvjax.pallas.ops.window_scores import xla as scoring
from kvjax.pallas import mgpu

RB = mgpu.ROWS  # rows per WGMMA
SMEM_Q = 128 << 10  # bytes of window queries pass 2 holds in SMEM
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per WGMMA row
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per WGMMA column


def reason(q_BTHD, k_BKTD, window: int, kernel: int, tile: int) -> str | None:
    B, T, H, D = q_BTHD.shape
    rows = -(-(H // k_BKTD.shape[1]) * window // RB) * RB
    item = jnp.dtype(k_BKTD.dtype).itemsize
    if k_BKTD.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"dtype {k_BKTD.dtype}"
    if (D * item) % 128 or tile % 64:
        return f"head dim {D} must fill 128-byte rows and tile={tile} be a multiple of 64"
    if rows * D * item > SMEM_Q:
        return f"{rows} window rows of head dim {D} exceed {SMEM_Q} bytes of SMEM"
    return None


def _bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _stats_body(q_g, k_g, valid_g, lim_g, m_g, l_g, q_s, lim_s, bar, *, K, tile, nt, per,
                scale):
    n, rb, sp = lax.axis_index("n"), lax.axis_index("rows"), lax.axis_index("split")
    plgpu.copy_gmem_to_smem(q_g.at[n, rb], q_s, bar)
    plgpu.copy_gmem_to_smem(lim_g.at[rb], lim_s, bar)
    plgpu.barrier_wait(bar)
    lim = mgpu.cast(lim_s[...], ROW)
    start = sp * per
    steps = jnp.maximum(jnp.minimum(per, nt - start), 0)

    def step(idx, k_s, valid_s, carry):
        m, l = carry
        s = mgpu.dot_nt(q_s, k_s) * scale  # [RB, tile]
        col = (start + idx[0]) * tile + mgpu.iota(s.shape, 1)
        ok = (col <= _bcast_rows(lim, s.shape)) & (
            _bcast_cols(mgpu.cast(valid_s[...], COL), s.shape) > 0)
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - _bcast_rows(m_safe, s.shape))
        return m_new, l * jnp.exp(m - m_safe) + p.sum(axis=1)

    D = q_s.shape[1]
    init = (mgpu.cast(jnp.full((RB,), -jnp.inf, jnp.float32), ROW),
            mgpu.cast(jnp.zeros((RB,), jnp.float32), ROW))
    m, l = plgpu.emit_pipeline(
        step, grid=(steps,),
        in_specs=[plgpu.BlockSpec((tile, D), lambda t: (start + t, 0),
                                  transforms=mgpu.swizzled(k_g.dtype)),
                  plgpu.BlockSpec((tile,), lambda t: (start + t,))],
        max_concurrent_steps=2, init_carry=init,
    )(k_g.at[n], valid_g.at[n // K])

    def write(m_s, l_s):
        m_s[...] = m
        l_s[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(m_s, m_g.at[n, sp, rb])
        plgpu.copy_smem_to_gmem(l_s, l_g.at[n, sp, rb])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((RB,), jnp.float32), plgpu.SMEM((RB,), jnp.float32))


def _scores_body(q_g, k_g, valid_g, lim_g, m_g, l_g, o_g, q_s, k_s, valid_s, lim_s, m_s, l_s,
                 bar, *, K, G, w, tile, scale):
    n, t = lax.axis_index("n"), lax.axis_index("tile")
    cols = pl.ds(t * tile, tile)
    copies = [(q_g.at[n, rb], q_s.at[rb]) for rb in range(q_s.shape[0])]  # 2-D TMA each
    copies += [(k_g.at[n, cols], k_s), (valid_g.at[n // K, cols], valid_s), (lim_g, lim_s),
               (m_g.at[n], m_s), (l_g.at[n], l_s)]
    for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)
    shape = (RB, tile)
    col = t * tile + mgpu.iota(shape, 1)
    live = _bcast_cols(mgpu.cast(valid_s[...], COL), shape) > 0
    c = [mgpu.cast(jnp.zeros((tile,), jnp.float32), COL) for _ in range(G)]
    for rb in range(q_s.shape[0]):
        s = mgpu.dot_nt(q_s.at[rb], k_s) * scale
        lim = mgpu.cast(lim_s[rb], ROW)
        m = mgpu.cast(m_s[rb], ROW)
        l = mgpu.cast(l_s[rb], ROW)
        m = jnp.where(m == -jnp.inf, 0.0, m)
        l = jnp.where(l > 0, l, 1.0)
        ok = (col <= _bcast_rows(lim, shape)) & live
        p = jnp.where(ok, jnp.exp(s - _bcast_rows(m, shape)) / _bcast_rows(l, shape), 0.0)
        row = rb * RB + mgpu.iota(shape, 0)
        for g in range(max(0, rb * RB // w), min(G, -(-(rb + 1) * RB // w))):  # heads here
            mine = (row >= g * w) & (row < (g + 1) * w)
            c[g] = c[g] + jnp.where(mine, p, 0.0).sum(axis=0)

    def write(c_s):
        for g in range(G):
            c_s[g] = c[g]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(c_s, o_g.at[n, :, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((G, tile), jnp.float32))


def epilogue(c_BKGP: Float[Array, "B K G P"], *, window: int, kernel: int, pooling: str,
             gqa: str, reduce: str) -> Float[Array, "B K P"]:
    """Window mean, per-head pooling and the GQA reduction, as the reference orders them."""
    c = c_BKGP / window if reduce == "mean" else c_BKGP
    return scoring.gqa_reduce(scoring.pool1d(c, kernel, pooling), gqa)


@functools.partial(jax.jit, static_argnames=(
    "window", "kernel", "pooling", "gqa", "reduce", "tile", "splits", "interpret"))
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
    tile: int = 128,
    splits: int = 8,
    interpret: bool = False,
) -> Float[Array, "B K P"]:
    B, T, H, D = q_BTHD.shape
    K = k_BKTD.shape[1]
    G, w = H // K, window
    R, P, N = G * w, T - w, B * K
    nb = -(-R // RB)
    nt, nP = pl.cdiv(T, tile), pl.cdiv(P, tile)
    splits = max(1, min(splits, nt))
    per = pl.cdiv(nt, splits)
    dt = k_BKTD.dtype
    qw = q_BTHD[:, T - w:].astype(dt).reshape(B, w, K, G, D).transpose(0, 2, 3, 1, 4)
    q = jnp.pad(qw.reshape(N, R, D), [(0, 0), (0, nb * RB - R), (0, 0)]).reshape(N, nb, RB, D)
    r = jnp.arange(nb * RB)
    lim = jnp.where(r < R, T - w + r % w, -1).astype(jnp.int32).reshape(nb, RB)  # last column
    valid = jnp.pad(valid_BT, [(0, 0), (0, nt * tile - T)]).astype(jnp.float32)
    k = k_BKTD.reshape(N, T, D)
    if interpret and T % tile:  # the device zero-fills the ragged tile; the interpreter cannot
        k = jnp.pad(k, [(0, 0), (0, nt * tile - T), (0, 0)])
    swz = mgpu.swizzled(dt)
    params = mgpu.interpret_params(interpret)
    with mgpu.tracing(interpret):
        m, l = plgpu.kernel(
            functools.partial(_stats_body, K=K, tile=tile, nt=nt, per=per, scale=D ** -0.5),
            out_type=[jax.ShapeDtypeStruct((N, splits, nb, RB), jnp.float32)] * 2,
            grid=(N, nb, splits), grid_names=("n", "rows", "split"),
            scratch_types=[plgpu.SMEM((RB, D), dt, transforms=swz),
                           plgpu.SMEM((RB,), jnp.int32), plgpu.Barrier(num_arrivals=2)],
            interpret=params,
        )(q, k, valid, lim)
        mx = jnp.max(m, axis=1)
        l = jnp.sum(jnp.where(l > 0, l * jnp.exp(m - jnp.where(jnp.isfinite(mx), mx, 0.0)[:, None]),
                              0.0), axis=1)
        c = plgpu.kernel(
            functools.partial(_scores_body, K=K, G=G, w=w, tile=tile, scale=D ** -0.5),
            out_type=jax.ShapeDtypeStruct((N, G, nP * tile), jnp.float32),
            grid=(N, nP), grid_names=("n", "tile"),
            scratch_types=[plgpu.SMEM((nb, RB, D), dt, transforms=swz),
                           plgpu.SMEM((tile, D), dt, transforms=swz),
                           plgpu.SMEM((tile,), jnp.float32), plgpu.SMEM((nb, RB), jnp.int32),
                           plgpu.SMEM((nb, RB), jnp.float32), plgpu.SMEM((nb, RB), jnp.float32),
                           plgpu.Barrier(num_arrivals=nb + 5)],
            interpret=params,
        )(q, k, valid, lim, mx, l)
    c = c[:, :, :P].reshape(B, K, G, P)
    return epilogue(c, window=w, kernel=kernel, pooling=pooling, gqa=gqa, reduce=reduce)
