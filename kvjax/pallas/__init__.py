"""Pallas kernels for KV-cache compression, one public op per kernel (ARCHITECTURE.md s. 5).

Each op takes `implementation=None | "xla" | "pallas_tpu" | "pallas_gpu"` and
`interpret=` (run a Pallas kernel in the CPU interpreter). None means the process default
(`set_default_implementation`, `python -m kvjax.run --kernels`), whose `auto` picks
Mosaic TPU on TPU, Mosaic GPU on Hopper or newer, and the `xla` reference elsewhere; an
op whose kernel cannot take the given inputs falls back to `xla` unless the kernel was
asked for by name. The reference is always the ground truth of the tests.

- `window_scores`: pooled, GQA-reduced window attention of the prefix (SnapKV family).
- `compact`: gather kept K, V, positions into fixed-capacity slots, write `valid`.
- `decode_attention`: one query per head over the masked cache, flash-decoding.
- `value_norms`: CriticalKV's projected value norms ||V_i W_O^h||_1.
"""

from kvjax.pallas.dispatch import (  # noqa: F401
    IMPLEMENTATIONS,
    backend_pallas,
    default_implementation,
    get_default_implementation,
    kernels_active,
    resolve,
    set_default_implementation,
)
from kvjax.pallas.ops.compact.api import compact  # noqa: F401
from kvjax.pallas.ops.decode_attention.api import decode_attention  # noqa: F401
from kvjax.pallas.ops.value_norms.api import value_norms  # noqa: F401
from kvjax.pallas.ops.window_scores.api import window_scores  # noqa: F401

__all__ = ["IMPLEMENTATIONS", "backend_pallas", "compact", "decode_attention",
           "default_implementation", "get_default_implementation", "kernels_active",
           "resolve", "set_default_implementation", "value_norms", "window_scores"]
