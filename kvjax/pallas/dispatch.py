"""Which implementation a kernel op runs, and whether Pallas runs interpreted.

The choice is data of the run, not a process global: `Kernels` names one choice per op
and is a static argument of every compiled program (so it is part of the compile key, as
MaxText's attention-kernel config field is). An op's own `implementation=` argument is
that choice: `auto` (or None) picks the best the backend compiles (Mosaic TPU on TPU,
Mosaic GPU on a Hopper-or-newer NVIDIA GPU, else the `xla` reference) and falls back to
`xla` for inputs a kernel does not take; `pallas` asks for the backend's kernel (on CPU:
the TPU kernel in the interpreter, for checks); a name from IMPLEMENTATIONS asks for
that kernel and raises when it cannot take the inputs.

`recording()` collects, while a program is traced, which implementation each op call
actually took, so that a run can report it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax

IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_gpu")
CHOICES = ("auto", "xla", "pallas", *IMPLEMENTATIONS)
OPS = ("window_scores", "compact", "decode_attention", "value_norms")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementation each kernel op runs (one of CHOICES per op); hashable and static."""

    window_scores: str = "auto"
    compact: str = "auto"
    decode_attention: str = "auto"
    value_norms: str = "auto"

    def __post_init__(self):
        for op in OPS:
            if getattr(self, op) not in CHOICES:
                raise ValueError(f"kernels: {op}={getattr(self, op)!r}; allowed: {CHOICES}")

    @classmethod
    def every(cls, choice: str | None) -> "Kernels":
        """The same choice for every op (`--kernels`)."""
        return cls(**{op: choice or "auto" for op in OPS})

    def active(self, op: str) -> bool:
        """Whether `op` goes to a Pallas kernel (before any per-input fallback); callers
        with their own jnp path (the engine's decode attention) keep it otherwise."""
        return resolve(getattr(self, op))[0] != "xla"

    def resolved(self) -> dict[str, str]:
        """{op: implementation} on this backend, before per-input fallbacks."""
        out = {}
        for op in OPS:
            impl, interp, _ = resolve(getattr(self, op))
            out[op] = impl + (" (interpreted)" if interp else "")
        return out


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


def resolve(choice: str | None, interpret: bool = False) -> tuple[str, bool, bool]:
    """-> (implementation, interpret, explicit). `explicit` is False for `auto`: the op
    may then fall back to xla for inputs a kernel does not take."""
    choice = choice or "auto"
    if choice not in CHOICES:
        raise ValueError(f"implementation={choice!r}; allowed: {CHOICES}")
    if choice == "auto":
        return backend_pallas() or "xla", interpret, False
    if choice == "pallas":
        best = backend_pallas()
        return (best, interpret, True) if best else ("pallas_tpu", True, True)
    return choice, interpret, True


_RECORDS: list[set] = []  # one set per active `recording()`


@contextlib.contextmanager
def recording():
    """Collect {(op, implementation)} of every op call traced inside the block."""
    used: set = set()
    _RECORDS.append(used)
    try:
        yield used
    finally:
        _RECORDS.remove(used)


def pick(op: str, implementation, interpret, reasons: dict[str, str | None]
         ) -> tuple[str, bool]:
    """Resolve, then fall back to xla when the chosen kernel gave a reason it cannot run
    (`reasons[impl]`), unless the caller asked for that kernel by name."""
    impl, interp, explicit = resolve(implementation, interpret)
    why = reasons.get(impl)
    if impl != "xla" and why:
        if explicit:
            raise ValueError(f"{op}: implementation={impl!r} cannot run these inputs: {why}")
        impl, interp = "xla", False
    for used in _RECORDS:
        used.add((op, impl + (" (interpreted)" if interp else "")))
    return impl, interp
