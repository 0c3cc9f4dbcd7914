"""Mosaic GPU projected value norms: WGMMA of a 64-token V tile by W_O^h tiles.

Grid (B*K, 64-token tiles): a warpgroup loads its V tile [64, Dh] into SMEM once, then
`emit_pipeline` streams the W_O^h tiles of the G query heads (stored transposed,
[hidden tile, Dh], the operand order tf32 WGMMA takes); each
WGMMA gives [64, hidden tile] in registers, whose L1 norm over the hidden axis is a row
reduction accumulated across tiles and heads. `V W_O` never reaches memory (W_O, shared
by every token tile, is served mostly from L2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from kvjax.pallas import mgpu

R = mgpu.ROWS


def reason(v_BKTD, o_HDM, hidden: int) -> str | None:
    Dh, M = v_BKTD.shape[-1], o_HDM.shape[1]
    dt = jnp.promote_types(v_BKTD.dtype, o_HDM.dtype)
    if dt not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"dtype {dt}"
    if (Dh * jnp.dtype(dt).itemsize) % 128 or M % hidden:
        return f"head dim {Dh} must fill 128-byte rows and hidden {M} split in {hidden} tiles"
    return None


def _body(v_g, w_g, o_g, v_s, bar, *, G, K, M, hidden):
    n, t = lax.axis_index("n"), lax.axis_index("tile")
    plgpu.copy_gmem_to_smem(v_g.at[n, pl.ds(t * R, R)], v_s, bar)
    plgpu.barrier_wait(bar)

    def step(_, w_s, acc):
        y = mgpu.dot_nt(v_s, w_s)  # [R, hidden]
        return acc + jnp.abs(y).sum(axis=1)

    acc = plgpu.emit_pipeline(
        step, grid=(G, M // hidden),
        in_specs=[plgpu.BlockSpec((None, hidden, v_s.shape[1]),
                                  lambda g, j: ((n % K) * G + g, j, 0),
                                  transforms=mgpu.swizzled(w_g.dtype))],
        max_concurrent_steps=2,
        init_carry=mgpu.cast(jnp.zeros((R,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )(w_g)

    def write(o_s):
        o_s[...] = acc / G
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[n, pl.ds(t * R, R)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((R,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("hidden", "interpret"))
def value_norms(
    v_BKTD: Float[Array, "B K T Dh"],
    o_HDM: Float[Array, "HDh M"],
    *,
    hidden: int = 128,
    interpret: bool = False,
) -> Float[Array, "B K T"]:
    B, K, T, Dh = v_BKTD.shape
    M = o_HDM.shape[1]
    H = o_HDM.shape[0] // Dh
    G, N = H // K, B * K
    nt = pl.cdiv(T, R)
    dt = jnp.promote_types(v_BKTD.dtype, o_HDM.dtype)
    v = v_BKTD.astype(dt).reshape(N, T, Dh)
    if interpret and T % R:  # the device zero-fills the ragged tile; the interpreter cannot
        v = jnp.pad(v, [(0, 0), (0, nt * R - T), (0, 0)])
    w = o_HDM.astype(dt).reshape(H, Dh, M).transpose(0, 2, 1)  # K-major for tf32 WGMMA
    with mgpu.tracing(interpret):
        out = plgpu.kernel(
            functools.partial(_body, G=G, K=K, M=M, hidden=hidden),
            out_type=jax.ShapeDtypeStruct((N, nt * R), jnp.float32),
            grid=(N, nt), grid_names=("n", "tile"),
            scratch_types=[plgpu.SMEM((R, Dh), dt, transforms=mgpu.swizzled(dt)),
                           plgpu.Barrier(num_arrivals=1)],
            interpret=mgpu.interpret_params(interpret),
        )(v, w)
    return out[:, :T].reshape(B, K, T)
