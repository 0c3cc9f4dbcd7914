"""Mosaic GPU helpers that keep one kernel source for the device and the CPU interpreter.

The Mosaic GPU interpreter of jax 0.10 runs `plgpu.kernel` bodies on CPU but has no rule
for `layout_cast`, for WGMMA with a register operand, or for transposed SMEM refs. Layout
casts only pin a register layout (a no-op for the values), and a WGMMA is a matmul: under
interpretation these helpers run the plain jnp equivalent, on the device the real
instruction. Everything else (grids, TMA copies, barriers, pipelines, masking, the online
softmax) runs the same code both ways; what interpretation cannot check is the WGMMA
itself, its layouts and its tf32 rounding of fp32 inputs.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_state = threading.local()
ROWS = 64  # WGMMA M: a warpgroup multiplies 64-row tiles


def interpreting() -> bool:
    return getattr(_state, "interpret", False)


@contextlib.contextmanager
def tracing(interpret: bool):
    """Trace a kernel body for the interpreter (True) or for the device (False)."""
    old = interpreting()
    _state.interpret = interpret
    try:
        yield
    finally:
        _state.interpret = old


def interpret_params(interpret: bool):
    """The `interpret=` value for `plgpu.kernel`: the GPU interpreter's params or None."""
    if not interpret:
        return None
    cls = getattr(plgpu, "InterpretParams", None)
    if cls is None:  # jax 0.10: not exported yet
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


def cast(x, layout):
    return x if interpreting() else plgpu.layout_cast(x, layout)


def iota(shape, dim: int, layout=plgpu.Layout.WGMMA):
    if interpreting():
        return jax.lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)


def _wide(x):
    """16-bit operands to fp32 for XLA:CPU (exact: their products are exact in fp32)."""
    return x.astype(jnp.float32)


def dot_nt(a_smem, b_smem):
    """a @ b.T in fp32 for SMEM refs a [M, k], b [N, k] (M a multiple of 64)."""
    if interpreting():
        return jax.lax.dot_general(_wide(a_smem[...]), _wide(b_smem[...]),
                                   (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((a_smem.shape[0], b_smem.shape[0]), jnp.float32))


def dot_nn(a, b_smem):
    """a @ b in fp32 for a register array a [M, k] (WGMMA layout) and an SMEM ref b [k, N]."""
    if interpreting():
        return jnp.dot(_wide(a), _wide(b_smem[...]), preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((a.shape[0], b_smem.shape[1]), jnp.float32))


def swizzled(dtype) -> tuple:
    """SMEM transforms WGMMA operands need: (8, 128 bytes) tiles, 128-byte swizzle."""
    elems = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128))

