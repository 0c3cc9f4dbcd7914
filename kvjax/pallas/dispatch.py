"""Which implementation a kernel op runs, and whether Pallas runs interpreted.

Order of precedence: the op's own `implementation=` argument, then the process default
(`set_default_implementation`, `--kernels` of `python -m kvjax.run`), then the best the
backend compiles: Mosaic TPU on TPU, Mosaic GPU on a Hopper-or-newer NVIDIA GPU, else the
`xla` reference. The default is read when a function is traced, so set it before the
first call of a jitted program (a compiled program keeps the choice it was traced with).
"""

from __future__ import annotations

import contextlib
import functools

import jax

IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_gpu")
DEFAULTS = ("auto", "xla", "pallas", *IMPLEMENTATIONS)

_default = "auto"  # the module-level switch


def get_default_implementation() -> str:
    return _default


def set_default_implementation(kind: str | None) -> None:
    """`auto` (None): Pallas where the backend compiles it, else xla. `pallas`: the
    backend's Pallas kernels; where none compiles (CPU, pre-Hopper GPU) the TPU kernels in
    the interpreter (slow; for checks). Or one of IMPLEMENTATIONS for every op."""
    global _default
    kind = "auto" if kind is None else kind
    if kind not in DEFAULTS:
        raise ValueError(f"kernels={kind!r}; allowed: {DEFAULTS}")
    _default = kind


@contextlib.contextmanager
def default_implementation(kind: str | None):
    """Temporarily set the process default (trace time)."""
    old = get_default_implementation()
    set_default_implementation(kind)
    try:
        yield
    finally:
        set_default_implementation(old)


@functools.cache
def _backend_pallas(backend: str) -> str | None:
    if backend == "tpu":
        return "pallas_tpu"
    if backend in ("gpu", "cuda"):
        dev = jax.devices(backend)[0]
        cc = getattr(dev, "compute_capability", None)  # "9.0" on H100; absent on ROCm
        if cc is not None and float(cc) >= 9.0:
            return "pallas_gpu"
    return None


def backend_pallas() -> str | None:
    """The Pallas implementation the default backend compiles, or None (CPU, older GPU)."""
    return _backend_pallas(jax.default_backend())


def resolve(implementation: str | None, interpret: bool = False) -> tuple[str, bool, bool]:
    """-> (implementation, interpret, explicit). `explicit` is False when the choice came
    from a default: the op may then fall back to xla for inputs a kernel does not take."""
    explicit = implementation is not None
    kind = implementation if explicit else get_default_implementation()
    if kind not in DEFAULTS:
        raise ValueError(f"implementation={kind!r}; allowed: None, {IMPLEMENTATIONS}")
    if kind == "auto":
        return backend_pallas() or "xla", interpret, False
    if kind == "pallas":
        best = backend_pallas()
        return (best, interpret, explicit) if best else ("pallas_tpu", True, explicit)
    return kind, interpret, explicit


def pick(implementation, interpret, reasons: dict[str, str | None]) -> tuple[str, bool]:
    """Resolve, then fall back to xla when the chosen kernel gave a reason it cannot run
    (`reasons[impl]`), unless the caller asked for that kernel by name."""
    impl, interp, explicit = resolve(implementation, interpret)
    why = reasons.get(impl)
    if impl != "xla" and why:
        if explicit:
            raise ValueError(f"implementation={impl!r} cannot run these inputs: {why}")
        return "xla", False
    return impl, interp


def kernels_active() -> bool:
    """Whether the process default sends ops to a Pallas kernel (callers that have their
    own jnp path, like `attention.attend`, keep it when this is False)."""
    return resolve(None)[0] != "xla"
