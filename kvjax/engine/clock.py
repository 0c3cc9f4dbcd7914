"""What the phases of one generation measured, and its compilations with `auto`'s fallback."""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax

from kvjax.engine.executables import compile_once
from kvjax.pallas.dispatch import Kernels


@dataclasses.dataclass
class Clock:
    """What the phases of one run measured: time to first token, compilation, decoding,
    and the kernel ops the compiled programs used; and the run's kernel choices, which a
    kernel that fails to compile turns to xla (`compiled`)."""

    config: Kernels = Kernels()
    ttft_s: float = 0.0
    compile_s: float = 0.0
    decode_s: float = 0.0
    kernels: set = dataclasses.field(default_factory=set)

    def compiled(self, fn, args, **static):
        """`fn` compiled with the run's kernels. A Pallas kernel that `auto` picked but
        that fails to lower or compile on this backend and jax version is replaced by the
        xla reference, for this program and the run's later ones, with one warning naming
        the ops and the reason; a kernel asked for by name raises."""
        try:
            exe, secs, used = compile_once(fn, args, kernels=self.config, **static)
        except Exception as e:
            fallback = self.config.fallback()
            if fallback == self.config:
                raise
            ops = [f.name for f in dataclasses.fields(Kernels)
                   if getattr(fallback, f.name) != getattr(self.config, f.name)]
            warnings.warn(f"kvjax: the {', '.join(ops)} kernel(s) that `auto` picked failed to "
                          f"compile on {jax.default_backend()} (jax {jax.__version__}): "
                          f"{type(e).__name__}: {str(e)[:300]}; running xla for them",
                          RuntimeWarning, stacklevel=3)
            self.config = fallback
            exe, secs, used = compile_once(fn, args, kernels=fallback, **static)
        self.compile_s += secs
        self.kernels |= used
        return exe

    def timed(self, exe, *args, phase: str = "ttft_s"):
        t0 = time.perf_counter()
        out = jax.block_until_ready(exe(*args))
        setattr(self, phase, getattr(self, phase) + time.perf_counter() - t0)
        return out
