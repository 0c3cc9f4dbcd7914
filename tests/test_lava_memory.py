"""LAVa's and CAKE's cascade bound the prefill's device memory (docs/methods.md, "LAVa").

XLA's compiled memory analysis of the engine's prefill program (temp + output bytes,
`kvjax.bench.cascade_memory.program_bytes`) on the bundled model at 2048 tokens, budget
128. The cascade's buffer is [L, B, K, S] slots (S = window + 8 x 96), its per-layer
state [L, B, K, P] scores, ranks and masks (13 bytes an entry); the full cache is
L * K * 2048 entries of 2 * 32 float32 (12 MiB).

- over SnapKV at the same budget (window scoring and a per-layer eviction, no cascade),
  the cascade costs at most twice its carry (the buffer and the state, each possibly
  held again as the program's output or a loop copy): were every layer's full K/V held
  (the scan output not dropped), it would cost 12 MiB more and fail this;
- `cascade=false` (every layer's full K/V until the end) costs at least half a full
  cache more than the cascade (measured: 8.6 MiB more for LAVa, 12 MiB full);
- the cascade's peak is below the full prefill's (the model's own working set, about
  37 MiB here, is common to all).
"""

from __future__ import annotations

import pytest

from kvjax import methods
from kvjax.bench.cascade_memory import program_bytes

N, BUDGET = 2048, 128


@pytest.fixture(scope="module")
def model():
    import kvjax

    return kvjax.load("tiny-retrieval")


_PEAKS: dict = {}


def peak(model, name: str, **kw) -> int:
    """The prefill program's temp + output bytes (compiled once per method)."""
    from kvjax.compression.method import Method

    key = (name, tuple(sorted(kw.items())))
    if key not in _PEAKS:
        m = Method() if name == "full" else methods.create(name, budget=BUDGET, **kw)
        _PEAKS[key] = program_bytes(model, m, N)["peak"]
    return _PEAKS[key]


@pytest.mark.parametrize("name", ["lava", "cake"])
def test_cascade_bounds_device_memory(model, name):
    cfg = model.cfg
    L, K, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    m = methods.create(name, budget=BUDGET)
    S, P = m.cache_slots(N, cfg), N - m.window
    per_entry = 2 * D * 4
    buffer = L * K * S * per_entry
    state = L * K * P * 13
    full_kv = L * K * N * per_entry
    assert buffer < full_kv / 2  # the setting is one where bounding matters
    bounded, unbounded = peak(model, name), peak(model, name, cascade=False)
    assert bounded - peak(model, "snapkv") <= 2 * (buffer + state)
    assert unbounded - bounded >= full_kv / 2
    assert bounded < peak(model, "full")
