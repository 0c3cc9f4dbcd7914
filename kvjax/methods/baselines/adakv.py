"""AdaKV (Feng et al. 2024, "Ada-KV: optimizing KV cache eviction by adaptive budget
allocation for efficient LLM inference"): Ada-SnapKV and Ada-PyramidKV.

SnapKV's score (window attention, pooled, GQA mean), but a layer's budget is shared by
its KV heads: one top-k over heads x positions keeps `K * b` entries (b = the layer's
per-head budget: `budget` for Ada-SnapKV, PyramidKV's schedule for Ada-PyramidKV), so
each head keeps as many entries as made the layer's top (LAVa paper Eq. 26). A safeguard
keeps a floor per head. Heads keep different numbers of live slots in the masked cache
(kvpress masks evicted keys instead; the AdaKV code uses a flattened varlen cache).

Budget split: the window is forced in every head and counts toward the layer's
`K * b`; the total over heads is exactly `K * b`.

Safeguard, `safeguard="kvpress"` (default; kvpress `AdaKVPress`, alpha_safeguard 0.2):
each head first keeps its own top `int(b * alpha)` entries (window included, so the
floor is spent on the window whenever `int(b * alpha) <= window`), then the flattened
top-k. `safeguard="code"` (FFY0/AdaKV `AdaptiveSnapKVCluster`): flattened top-k of
`K * (b - window)` prefix entries, head counts mixed with a uniform floor
`round(count * (1 - alpha) + int((b - window) * alpha))`, window on top -- the total
may then differ from `K * b` by rounding.

Defaults (AdaKV code and paper: window 32, maxpool 7, floor_alpha 0.2; GQA mean as its
GQA support and kvpress). For Ada-PyramidKV the schedule is `kvjax.compression.budgets.pyramid`
(kvpress's float form; the AdaKV code's `pyram_mode` uses integer division).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.compression import budgets
from kvjax.compression.eviction import HeadBudgets, WindowScored, real_length
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.registry import register
from kvjax.methods.baselines.pyramidkv import PyramidSchedule, _table

SAFEGUARDS = ("kvpress", "code")


def n_safe(b: int, alpha: float) -> int:
    """kvpress: int(n_kept * alpha), at least 1 when alpha > 0 and n_kept > 0."""
    s = int(b * alpha)
    return (max(1, s) if b > 0 else 0) if alpha > 0 else s


@lru_cache(maxsize=64)
def _safe_table(budget, n_max, num_layers, window, beta, alpha) -> np.ndarray:
    t = _table(budget, n_max, num_layers, window, beta)
    return np.vectorize(lambda b: n_safe(int(b), alpha))(t).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class AdaKVBase(WindowScored):
    name: ClassVar[str] = "_adakv"
    alpha: float = 0.2
    safeguard: str = "kvpress"

    def validate(self, n: int, cfg: ModelConfig) -> None:
        super().validate(n, cfg)
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha} outside [0, 1]")
        if self.safeguard not in SAFEGUARDS:
            raise ValueError(f"safeguard={self.safeguard!r}; allowed: {SAFEGUARDS}")

    def max_budget(self, n: int) -> int:
        return self.budget

    def kept_slots(self, n: int) -> int:
        return n  # one head may keep up to every entry (bounded on a known model below)

    def cache_slots(self, n: int, cfg: ModelConfig) -> int:
        # one head may keep up to the layer's total; every other head keeps the window
        K = cfg.num_kv_heads
        return int(min(n, K * self.max_budget(n) - (K - 1) * self.window))

    def splits_heads(self) -> bool:
        return True  # per-head scores; the flattened top-k across devices (`io.heads`)

    def safe_count(self, io: LayerIO, state):
        return jnp.full(io.k.shape[:1], n_safe(self.budget, self.alpha), jnp.int32)

    def head_budgets(self, io: LayerIO, s_BKT, state) -> HeadBudgets:
        """kvpress: the counts of one top-k over heads x positions after each head's
        safeguard entries (which a wrapper's first stage must keep); the code variant: its
        counts mixed with a uniform floor."""
        B, K, T = s_BKT.shape
        b = jnp.minimum(self.head_count(io, state), real_length(io))  # [B]
        if self.safeguard == "kvpress":
            b_max = self.max_budget(T)
            keep, safe = budgets.flattened_heads(s_BKT, b[:, None], self.safe_count(io, state),
                                                 b_max, n_safe(b_max, self.alpha), with_safe=True,
                                                 heads=io.heads)
            return HeadBudgets(jnp.sum(keep, axis=-1, dtype=jnp.int32), safe, keep)
        w = self.window
        return HeadBudgets(budgets.adakv_code_counts(s_BKT[..., : T - w], b - w, self.alpha,
                                                     io.heads) + w)


@register
@dataclasses.dataclass(frozen=True)
class AdaSnapKV(AdaKVBase):
    """Ada-SnapKV: SnapKV scores, `K * budget` entries per layer chosen by one top-k over
    heads x positions (window forced), safeguard alpha 0.2 (kvpress semantics)."""

    name: ClassVar[str] = "ada_snapkv"


@register
@dataclasses.dataclass(frozen=True)
class AdaPyramidKV(PyramidSchedule, AdaKVBase):
    """Ada-PyramidKV: the layer's `K * b_l` (b_l from PyramidKV's schedule, beta 20) chosen
    by one top-k over heads x positions, safeguard alpha 0.2 (kvpress semantics)."""

    name: ClassVar[str] = "ada_pyramidkv"
    beta: float = 20

    def validate(self, n: int, cfg: ModelConfig) -> None:
        super().validate(n, cfg)
        self.validate_beta()

    def max_budget(self, n: int) -> int:
        return max(self.max_head_count(n), self.budget)

    def init_state(self, cfg: ModelConfig, batch: int, n: int):
        args = (self.budget, n, cfg.num_layers, self.window, float(self.beta))
        return jnp.asarray(_table(*args)), jnp.asarray(_safe_table(*args, self.alpha))

    def head_count(self, io: LayerIO, state):
        return PyramidSchedule.head_count(self, io, state[0])

    def splits_heads(self) -> bool:
        return True  # per-head scores; the flattened top-k across devices (`io.heads`)

    def safe_count(self, io: LayerIO, state):
        return PyramidSchedule.head_count(self, io, state[1])
