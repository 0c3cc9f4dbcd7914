"""Ahead-of-time compiled programs, cached per (static arguments, argument shapes).

Lowering and compiling explicitly lets the driver time compilation apart from the run,
and lets it record which kernel implementation each op took while the program was traced.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.pallas.dispatch import recording

_EXECUTABLES: dict = {}


def compile_once(fn, args: tuple, **static):
    """(executable, compile seconds, kernel ops used): `fn` AOT-compiled once per (static
    args, argument shapes and shardings); 0.0 seconds when an earlier call compiled it.
    The ops used are {(op, implementation)} recorded while tracing."""
    leaves, tree = jax.tree.flatten(args)
    key = (fn, tuple(sorted(static.items())), tree,
           tuple((np.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves))
    if key in _EXECUTABLES:
        exe, used = _EXECUTABLES[key]
        return exe, 0.0, used
    t0 = time.perf_counter()
    with recording() as used:
        exe = fn.lower(*args, **static).compile()
    _EXECUTABLES[key] = exe, frozenset(used)
    return exe, time.perf_counter() - t0, frozenset(used)


def clear_compiled() -> None:
    """Drop every executable `compile_once` and `jax.jit` hold. Each keeps its machine code
    mapped: a sweep that compiled ~110 (method, budget) pairs in one process ran out of
    memory maps (vm.max_map_count 65530; LLVM: "Cannot allocate memory", SIGSEGV)."""
    _EXECUTABLES.clear()
    jax.clear_caches()


def compiled_count() -> int:
    """How many executables `compile_once` holds."""
    return len(_EXECUTABLES)
