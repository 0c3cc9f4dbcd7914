"""Mosaic TPU window scores: two passes over key tiles, pooling fused with a one-tile delay.

Pass 1 streams every key tile once and keeps each window query's running max and sum
(online softmax, fp32) in VMEM: only [rows] statistics reach HBM. Pass 2 streams the
prefix tiles again, turns each tile's logits into probabilities with those statistics,
sums them over the window per query head and keeps the [G, tile] column scores in VMEM.
Pooling needs `kernel // 2` columns of the next tile, so the pooled, group-reduced
scores of tile t-1 are written at step t: the grid has one extra step, and a halo of
`HALO` columns on each side of the buffer carries the neighbours' scores. Nothing of
size [heads, window, n] is ever written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float

from kvjax.pallas import mosaic

HALO = 128  # lane-aligned halo; pooling kernels up to 2 * HALO + 1 wide
LANES = 128  # row statistics are kept lane-replicated, as in jax's TPU flash attention


def reason(q_BTHD, k_BKTD, window: int, kernel: int, tile: int) -> str | None:
    """Why this kernel cannot take these inputs (None: it can)."""
    if tile % 128 or tile < HALO:
        return f"tile={tile} must be a multiple of 128"
    if kernel // 2 > HALO:
        return f"pooling kernel={kernel} wider than {2 * HALO + 1}"
    return None


def _logits(q_ref, k_ref, valid_ref, t, *, T, w, tile, scale, interpret):
    """Masked logits [R, tile] of the window queries against key tile t (-inf where a
    query may not look: padding, its future, past the end of the prompt)."""
    s = mosaic.dot(q_ref[...], k_ref[...], (1, 1), interpret) * scale
    R = s.shape[0]
    col = t * tile + jax.lax.broadcasted_iota(jnp.int32, (R, tile), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (R, tile), 0)
    ok = (col <= T - w + row % w) & (valid_ref[...] != 0)
    return jnp.where(ok, s, -jnp.inf)


def _stats_kernel(q_ref, k_ref, valid_ref, m_ref, l_ref, m_sc, l_sc, *, T, w, tile, scale,
                  interpret):
    t = pl.program_id(2)

    @pl.when(t == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

    s = _logits(q_ref, k_ref, valid_ref, t, T=T, w=w, tile=tile, scale=scale,
                interpret=interpret)
    m_old = m_sc[...]
    m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)  # exp(-inf) = 0 on masked columns
    l_sc[...] = l_sc[...] * jnp.exp(m_old - m_safe) + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_new

    @pl.when(t == pl.num_programs(2) - 1)
    def _():
        m_ref[...] = jnp.broadcast_to(m_sc[...], m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_sc[...], l_ref.shape)


def _pool(x, kernel: int, kind: str, tile: int):
    """Stride-1 pooling of the centre `tile` columns of x [G, HALO + tile + HALO]."""
    pad = kernel // 2
    width = x.shape[1]
    acc = None
    for d in range(-pad, pad + 1):
        y = x if d == 0 else pltpu.roll(x, (-d) % width, 1)  # y[:, j] = x[:, j + d]
        y = y[:, HALO: HALO + tile]
        acc = y if acc is None else (acc + y if kind == "avg" else jnp.maximum(acc, y))
    return acc / kernel if kind == "avg" else acc


def _gqa(x, how: str):
    if how == "sum":
        return jnp.sum(x, axis=0, keepdims=True)
    if how == "mean":
        return jnp.mean(x, axis=0, keepdims=True)
    return jnp.max(x, axis=0, keepdims=True)


def _score_kernel(q_ref, k_ref, valid_ref, m_ref, l_ref, o_ref, buf, c_sc, *, T, w, G, P,
                  nP, tile, scale, kernel, pooling, gqa, reduce, interpret):
    t = pl.program_id(2)
    fill = -jnp.inf if pooling == "max" else 0.0  # what pooling sees beyond the prefix

    @pl.when(t == 0)
    def _():
        buf[...] = jnp.full(buf.shape, fill, jnp.float32)

    @pl.when(t < nP)
    def _():
        s = _logits(q_ref, k_ref, valid_ref, t, T=T, w=w, tile=tile, scale=scale,
                    interpret=interpret)
        m = m_ref[:, :1]
        l = l_ref[:, :1]
        p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)) / jnp.where(l > 0, l, 1.0)
        for g in range(G):  # window sum per query head
            c_sc[g:g + 1, :] = jnp.sum(p[g * w:(g + 1) * w], axis=0, keepdims=True)
        c = c_sc[...] / w if reduce == "mean" else c_sc[...]
        col = t * tile + jax.lax.broadcasted_iota(jnp.int32, (G, tile), 1)
        c_sc[...] = jnp.where(col < P, c, fill)

    @pl.when(t == nP)
    def _():
        c_sc[...] = jnp.full(c_sc.shape, fill, jnp.float32)

    @pl.when(t > 0)
    def _():  # pool tile t-1 now that the first columns of tile t are known
        buf[:, HALO + tile:] = c_sc[:, :HALO]
        pooled = _pool(buf[...], kernel, pooling, tile)
        o_ref[...] = _gqa(pooled, gqa)

    buf[:, :HALO] = buf[:, tile: tile + HALO]  # last HALO columns of the centre
    buf[:, HALO: HALO + tile] = c_sc[...]


@functools.partial(jax.jit, static_argnames=(
    "window", "kernel", "pooling", "gqa", "reduce", "tile", "interpret"))
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
    tile: int = 512,
    interpret: bool = False,
) -> Float[Array, "B K P"]:
    B, T, H, D = q_BTHD.shape
    K = k_BKTD.shape[1]
    G, w = H // K, window
    R, P = G * w, T - w
    if pooling == "none":
        kernel = 1
    qw = q_BTHD[:, T - w:].reshape(B, w, K, G, D).transpose(0, 2, 3, 1, 4).reshape(B, K, R, D)
    valid = valid_BT.astype(jnp.int32)[:, None, :]  # [B, 1, T]: no bool refs on TPU
    scale = D ** -0.5
    nt, nP = pl.cdiv(T, tile), pl.cdiv(P, tile)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    q_spec = pl.BlockSpec((None, None, R, D), lambda b, k, t: (b, k, 0, 0))
    row_spec = pl.BlockSpec((None, None, R, LANES), lambda b, k, t: (b, k, 0, 0))

    m, l = pl.pallas_call(
        functools.partial(_stats_kernel, T=T, w=w, tile=tile, scale=scale,
                          interpret=bool(interpret)),
        grid=(B, K, nt),
        in_specs=[q_spec,
                  pl.BlockSpec((None, None, tile, D), lambda b, k, t: (b, k, t, 0)),
                  pl.BlockSpec((None, 1, tile), lambda b, k, t: (b, 0, t))],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((B, K, R, LANES), jnp.float32)] * 2,
        scratch_shapes=[pltpu.VMEM((R, 1), jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="window_stats",
    )(qw, k_BKTD, valid)

    last = lambda t: jnp.minimum(t, nP - 1)  # the extra step refetches nothing
    out = pl.pallas_call(
        functools.partial(_score_kernel, T=T, w=w, G=G, P=P, nP=nP, tile=tile, scale=scale,
                          kernel=kernel, pooling=pooling, gqa=gqa, reduce=reduce,
                          interpret=bool(interpret)),
        grid=(B, K, nP + 1),
        in_specs=[q_spec,
                  pl.BlockSpec((None, None, tile, D), lambda b, k, t: (b, k, last(t), 0)),
                  pl.BlockSpec((None, 1, tile), lambda b, k, t: (b, 0, last(t))),
                  row_spec, row_spec],
        out_specs=pl.BlockSpec((None, None, 1, tile),
                               lambda b, k, t: (b, k, 0, jnp.maximum(t - 1, 0))),
        out_shape=jax.ShapeDtypeStruct((B, K, 1, P), jnp.float32),
        scratch_shapes=[pltpu.VMEM((G, HALO + tile + HALO), jnp.float32),
                        pltpu.VMEM((G, tile), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="window_scores",
    )(qw, k_BKTD, valid, m, l)
    return out[:, :, 0]
