"""Pallas kernels for KV-cache compression, one public op per kernel (docs/design.md,
"Kernels").

Each op takes `implementation=` (one of `dispatch.CHOICES`; None is `auto`) and
`interpret=` (run a Pallas kernel in the CPU interpreter). `auto` picks Mosaic TPU on
TPU, Mosaic GPU on Hopper or newer, and the `xla` reference elsewhere, and falls back to
`xla` for inputs a kernel cannot take; a kernel asked for by name raises instead. A run
passes its choices as a static `Kernels` value (`--kernels`), never as a process global.
The reference is always the ground truth of the tests.

- `window_scores`: pooled, GQA-reduced window attention of the prefix (SnapKV family).
- `compact`: gather kept K, V, positions into fixed-capacity slots, write `valid`.
- `decode_attention`: one query per head over the masked cache, flash-decoding.
- `value_norms`: CriticalKV's projected value norms ||V_i W_O^h||_1.
"""

from kvjax.pallas.dispatch import (  # noqa: F401
    CHOICES,
    IMPLEMENTATIONS,
    OPS,
    Kernels,
    backend_pallas,
    recording,
    resolve,
)
from kvjax.pallas.ops.compact.api import compact  # noqa: F401
from kvjax.pallas.ops.decode_attention.api import decode_attention  # noqa: F401
from kvjax.pallas.ops.value_norms.api import value_norms  # noqa: F401
from kvjax.pallas.ops.window_scores.api import window_scores  # noqa: F401

__all__ = ["CHOICES", "IMPLEMENTATIONS", "OPS", "Kernels", "backend_pallas", "compact",
           "decode_attention", "recording", "resolve", "value_norms", "window_scores"]
