"""CriticalKV as a composable selection rule over PrefillEviction methods.

`CriticalRule` is a mixin placed before any PrefillEviction-style base whose `scores`
give the base attention score (forced entries +inf, padding -inf): it replaces the base's
`keep` by the two-stage rule of `kvjax.critical` at the same per-head budget b --
stage 1 keeps the top `int(first_stage_ratio * b)` by attention, stage 2 fills the rest
by `(score + epsilon) * mean_g ||v_i W_O^h||_1`; the window (+inf) is always kept.
The layer's W_O reaches the hook through `LayerIO.wo` (set by `transformer.prefill`).

Registered: `critical_snapkv` (kvpress `CriticalKVPress(SnapKVPress)`),
`critical_pyramidkv` (PyramidKV's per-layer b), `critical_adakv` (kvpress
`CriticalAdaKVPress`: AdaKV's flattened head budgets with its 0.2 safeguard decide b_h,
the safeguard entries join stage 1, then the two stages per head). Defaults
first_stage_ratio 0.5, epsilon 1e-4 (paper and kvpress).

One deliberate difference from kvpress: kvjax forces the window (+inf), kvpress scores it
`max + 1` and keeps it only where stage 1 (or AdaKV's safeguard) covers it, i.e. when
`int(0.5 b) >= window`; the two agree whenever that holds.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax import budgets, critical, pallas, select
from kvjax.config import ModelConfig
from kvjax.methods import register
from kvjax.methods.adakv import AdaKVBase, n_safe
from kvjax.methods.eviction import real_length
from kvjax.methods.pyramidkv import PyramidKV
from kvjax.methods.snapkv import SnapKV
from kvjax.models.transformer import LayerIO


@dataclasses.dataclass(frozen=True)
class CriticalRule:
    """Mixin: CriticalKV's two-stage selection at the base method's per-head budgets."""

    first_stage_ratio: float = critical.ALPHA
    epsilon: float = critical.EPS
    norm_block: int = 256

    def validate(self, n: int, cfg: ModelConfig) -> None:
        super().validate(n, cfg)
        if not 0 <= self.first_stage_ratio <= 1:
            raise ValueError(f"first_stage_ratio={self.first_stage_ratio} outside [0, 1]")
        if self.epsilon < 0:
            raise ValueError(f"epsilon={self.epsilon} must be >= 0")

    def projected_norms(self, io: LayerIO):
        if io.wo is None:
            raise ValueError(f"{self.name}: the layer's W_O is missing from LayerIO (CriticalKV "
                             "needs transformer.prefill's `wo`; not available in this path)")
        return pallas.value_norms(io.v, io.wo, block=self.norm_block)

    def head_budgets(self, io: LayerIO, s_BKT, state):
        """[B, K] per-head budgets b (the base's uniform / per-layer count)."""
        B, K = s_BKT.shape[:2]
        b = jnp.minimum(self.layer_budget(io, state), real_length(io))
        return jnp.broadcast_to(b[:, None], (B, K)), None

    def keep(self, io: LayerIO, s_BKT, S: int, state):
        b, extra = self.head_budgets(io, s_BKT, state)
        s2 = critical.two_stage_scores(s_BKT, self.projected_norms(io), b, S,
                                       self.first_stage_ratio, self.epsilon, extra)
        return select.slots_from_scores(s2, b, S)


@register
@dataclasses.dataclass(frozen=True)
class CriticalSnapKV(CriticalRule, SnapKV):
    """CriticalKV on SnapKV: uniform budget, two stages (ratio 0.5, eps 1e-4)."""

    name: ClassVar[str] = "critical_snapkv"


@register
@dataclasses.dataclass(frozen=True)
class CriticalPyramidKV(CriticalRule, PyramidKV):
    """CriticalKV on PyramidKV: PyramidKV's per-layer budgets, two stages per head."""

    name: ClassVar[str] = "critical_pyramidkv"


@register
@dataclasses.dataclass(frozen=True)
class CriticalAdaKV(CriticalRule, AdaKVBase):
    """CriticalAdaKV (kvpress `CriticalAdaKVPress`): AdaKV head budgets (safeguard alpha),
    safeguard entries + top int(ratio * b_h) in stage 1, the rest by (s + eps) * norm."""

    name: ClassVar[str] = "critical_adakv"

    def validate(self, n: int, cfg: ModelConfig) -> None:
        super().validate(n, cfg)
        if self.safeguard != "kvpress":
            raise ValueError("critical_adakv supports safeguard='kvpress' only "
                             "(kvpress CriticalAdaKVPress semantics)")

    def head_budgets(self, io: LayerIO, s_BKT, state):
        B, K, T = s_BKT.shape
        b = jnp.minimum(self.layer_budget(io, state), real_length(io))  # [B]
        b_max = self.max_budget(T)
        max_safe = n_safe(b_max, self.alpha)
        safe = self.safe_count(io, state)  # [B]
        mask = budgets.flattened_heads(s_BKT, b[:, None], safe, b_max, max_safe)
        hb = jnp.sum(mask, axis=-1, dtype=jnp.int32)  # [B, K]
        extra = critical.top_mask(s_BKT, jnp.broadcast_to(safe[:, None], (B, K)), max_safe) \
            if max_safe > 0 else None
        return hb, extra
