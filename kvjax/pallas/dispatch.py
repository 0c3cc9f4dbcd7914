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
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_gpu")
CHOICES = ("auto", "xla", "pallas", *IMPLEMENTATIONS)
OPS = ("window_scores", "compact", "decode_attention", "value_norms")
# the prompt's attention: "xla" = kvjax's chunked attention; "cudnn" = one fused call
# (`jax.nn.dot_product_attention`, cuDNN's flash attention); "fused_xla" = the same call's
# xla implementation (it materialises the scores: small prompts and tests)
PREFILL_ATTENTION = ("auto", "xla", "blocked", "cudnn", "fused_xla")
# decode's layer loop: "scan" = one `lax.scan` over the stacked [L, ...] weights and cache
# (compile time flat in depth); "per_layer" = a Python loop over per-layer buffers, split
# once per generation, so a step reads each layer's weights and KV where they lie (the scan
# copies each layer's slice out of the stacked arrays every step: docs/results/gpu_targets.md;
# `kvjax.bench.decode_layout`: 33% -> 83% of the memory bound on an H100). For methods
# whose step hooks read one layer at a time (`Method.layered_hooks`: the plain step, and
# the evicting and merging ones); SlimInfer's and LazyLLM's (revival, a host loop) keep the
# scan.
# `auto` is the scan everywhere: on an H200 (2026-11-28, docs/results/gpu.md run 4) the
# per-layer loop ran the full cache at 50-56% of the bound at batch 1 (scan 39-41%) but at
# 11% at 8k batch 8 (scan 40%); on an H100 (runs 5-7) the 32-layer loop ran out of memory
# at 8k x 4 and x 8: the per-generation split holds a second copy of the layer weights and
# of the cache (21 GiB at 8k x 8). On 16 layers it took 0.47 of the scan's device time a
# token (speed.md, "Why the loop lost"). A model stored per layer (`Model.with_layers`)
# holds no copy of the weights: `auto` takes the loop for it (the decode program's
# temporaries on the 8B shape at 8k x 8: the cache's split, 16.1 GiB in float32, against
# 42.1 for a stacked model; `python -m kvjax.bench.decode_hlo`).
DECODE_LAYERS = ("auto", "scan", "per_layer")
CUDNN_DTYPES = ("bfloat16", "float16")  # what cuDNN's flash attention takes (and fp8)
# (backend, op) pairs whose Pallas kernel was measured faster than the xla reference on that
# kind of device: `auto` picks Pallas only there (docs/results/gpu.md; H100, jax 0.11.2,
# 2026-11-26, 8k and 32k: window_scores 1.10-1.21x, value_norms 6.5-9.0x; decode_attention
# 0.64-0.68x; compact 1.06x at 8k but 0.69x at 32k). TPU kernels are unmeasured: `auto`
# keeps xla there until they are.
MEASURED_FASTER = {("gpu", "window_scores"), ("gpu", "value_norms")}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementation each kernel op runs (one of CHOICES per op); hashable and static."""

    window_scores: str = "auto"
    compact: str = "auto"
    decode_attention: str = "auto"
    value_norms: str = "auto"
    prefill_attention: str = "auto"
    decode_layers: str = "auto"
    # decode steps between two checks of the loop's stop condition (plain decode steps
    # only): on a GPU each check is a copy to the host that the next step waits on
    # (docs/results/speed.md, the launch gap); k > 1 compiles k steps into one loop
    # iteration, and after every element stopped runs at most k - 1 steps that write
    # only dead entries
    decode_unroll: int = 1

    def __post_init__(self):
        for op in OPS:
            if getattr(self, op) not in CHOICES:
                raise ValueError(f"kernels: {op}={getattr(self, op)!r}; allowed: {CHOICES}")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"kernels: prefill_attention={self.prefill_attention!r}; allowed: "
                             f"{PREFILL_ATTENTION}")
        if self.decode_layers not in DECODE_LAYERS:
            raise ValueError(f"kernels: decode_layers={self.decode_layers!r}; allowed: "
                             f"{DECODE_LAYERS}")
        if type(self.decode_unroll) is not int or self.decode_unroll < 1:
            raise ValueError(f"kernels: decode_unroll={self.decode_unroll!r}; allowed: an "
                             f"int >= 1 (decode steps between two checks of the stop "
                             f"condition)")

    @classmethod
    def every(cls, choice: str | None) -> "Kernels":
        """The same choice for every kernel op (`--kernels`); "xla" also keeps the prompt's
        attention on kvjax's chunked attention, any other leaves it to `auto`."""
        choice = choice or "auto"
        return cls(**{op: choice for op in OPS},
                   prefill_attention="xla" if choice == "xla" else "auto")

    def active(self, op: str) -> bool:
        """Whether `op` goes to a Pallas kernel (before any per-input fallback); callers
        with their own jnp path (the engine's decode attention) keep it otherwise."""
        return resolve(getattr(self, op), op=op)[0] != "xla"

    def prompt_attention(self, dtype) -> str:
        """The prompt attention's implementation for queries of `dtype`: `auto` is cuDNN's
        fused attention on an NVIDIA GPU for 16-bit queries (measured: 643 TFLOP/s on one
        H100 layer at 32k; cuDNN refuses float32), the tiled online-softmax attention on
        CPU (`attention.attend_blocked`: 2.2x the chunked one at 2048 on 2 cores), the
        chunked xla attention elsewhere. Recorded as used (`recording`): callers call it
        when tracing the attention."""
        impl, name = self.prefill_attention, jnp.dtype(dtype).name
        if impl == "auto":
            impl = _auto_prompt_attention()
            if impl == "cudnn" and name not in CUDNN_DTYPES:
                impl = "xla"
        elif impl == "cudnn" and name not in CUDNN_DTYPES:
            raise ValueError(f"kernels: prefill_attention='cudnn' takes {CUDNN_DTYPES} "
                             f"queries, not {name}; use 'auto' or 'xla'")
        note("prefill_attention", impl)
        return impl

    def decode_layout(self) -> str:
        """Decode's layer loop for a stacked model (under `auto` the engine loops over a
        model stored per layer): `auto` is "scan" (see DECODE_LAYERS: the per-layer loop
        is faster at batch 1 on a GPU, 3.6x slower at batch 8, and compiles 3-4x slower on
        CPU). Recorded as used when asked (callers ask while tracing the decode loop)."""
        impl = self.decode_layers if self.decode_layers != "auto" else _auto_decode_layers()
        note("decode_layers", impl)
        return impl

    def resolved(self) -> dict[str, str]:
        """{op: implementation} on this backend, before per-input fallbacks."""
        out = {}
        for op in OPS:
            impl, interp, _ = resolve(getattr(self, op), op=op)
            out[op] = impl + (" (interpreted)" if interp else "")
        auto = _auto_prompt_attention()
        return {**out, "prefill_attention": auto if self.prefill_attention == "auto"
                else self.prefill_attention,
                "decode_layers": self.decode_layers if self.decode_layers != "auto"
                else _auto_decode_layers()}

    def fallback(self) -> "Kernels":
        """These kernels with every op that `auto` sent to Pallas on xla instead (a run's
        answer to a kernel that fails to lower or compile on the running backend)."""
        return dataclasses.replace(self, **{
            op: "xla" for op in OPS
            if getattr(self, op) == "auto" and resolve("auto", op=op)[0] != "xla"},
            **({"prefill_attention": "xla"} if self.prefill_attention == "auto"
               and self.resolved()["prefill_attention"] != "xla" else {}))


@functools.cache
def _nvidia(backend: str) -> bool:
    return backend in ("gpu", "cuda") and "nvidia" in jax.devices(backend)[0].device_kind.lower()


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


def resolve(choice: str | None, interpret: bool = False, op: str | None = None
            ) -> tuple[str, bool, bool]:
    """-> (implementation, interpret, explicit). `explicit` is False for `auto`: the op
    may then fall back to xla for inputs a kernel does not take. `auto` takes the backend's
    Pallas kernel only for the ops measured faster on that kind of device
    (MEASURED_FASTER; any op when `op` is None)."""
    choice = choice or "auto"
    if choice not in CHOICES:
        raise ValueError(f"implementation={choice!r}; allowed: {CHOICES}")
    if choice == "auto":
        best = backend_pallas()
        kind = "tpu" if best == "pallas_tpu" else "gpu"
        if best is None or (op is not None and (kind, op) not in MEASURED_FASTER):
            return "xla", interpret, False
        return best, interpret, False
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


def note(op: str, implementation: str) -> None:
    """Record that `op` took `implementation` in the program being traced (`recording`)."""
    for used in _RECORDS:
        used.add((op, implementation))


def pick(op: str, implementation, interpret, reasons: dict[str, str | None]
         ) -> tuple[str, bool]:
    """Resolve, then fall back to xla when the chosen kernel gave a reason it cannot run
    (`reasons[impl]`), unless the caller asked for that kernel by name."""
    impl, interp, explicit = resolve(implementation, interpret, op)
    why = reasons.get(impl)
    if impl != "xla" and why:
        if explicit:
            raise ValueError(f"{op}: implementation={impl!r} cannot run these inputs: {why}")
        impl, interp = "xla", False
    note(op, impl + (" (interpreted)" if interp else ""))
    return impl, interp


def _auto_prompt_attention() -> str:
    backend = jax.default_backend()
    return "cudnn" if _nvidia(backend) else "blocked" if backend == "cpu" else "xla"


def _auto_decode_layers() -> str:
    return "scan"
