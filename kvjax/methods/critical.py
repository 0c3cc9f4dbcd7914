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
the safeguard entries join stage 1, then the two stages per head), `critical_headkv`
(HeadKV's static b_h from offline head scores; the paper's third integration, Sec. 5),
`critical_lava` (LAVa's per-head counts after its head and layer allocation, i.e. the
live entries of each head of its final masks, then the two stages per head on LAVa's own
Eq. 5 score; not in the paper, METHODS.md section 4 asks for it). Defaults
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
from kvjax.methods.headkv import HeadKV
from kvjax.methods.lava import LAVa
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


@register
@dataclasses.dataclass(frozen=True)
class CriticalHeadKV(CriticalRule, HeadKV):
    """CriticalKV on HeadKV: HeadKV's static per-head budgets b_h (head scores, beta 1.005),
    two stages per head (ratio 0.5, eps 1e-4)."""

    name: ClassVar[str] = "critical_headkv"
    head_budgets = HeadKV.head_budgets  # HeadKV's b_h, not CriticalRule's uniform one


@register
@dataclasses.dataclass(frozen=True)
class CriticalLAVa(CriticalRule, LAVa):
    """CriticalKV on LAVa: LAVa decides how many entries each (layer, head) keeps (Eq. 5-7,
    cascading), the two stages decide which, with LAVa's Eq. 5 score as the attention score.

    While cascading, the intermediate masks (and so the peak live count) are LAVa's own;
    only the final choice inside each head changes, at the same counts.
    """

    name: ClassVar[str] = "critical_lava"

    def init_state(self, cfg: ModelConfig, batch: int, n: int):
        st = super().init_state(cfg, batch, n)
        return {**st, "norm": jnp.zeros_like(st["scores"])}  # [L, B, K, P]

    def after_layer_prefill(self, io: LayerIO, st):
        out, st = super().after_layer_prefill(io, st)
        P = st["norm"].shape[-1]
        return out, {**st, "norm": st["norm"].at[io.layer].set(self.projected_norms(io)[..., :P])}

    def final_keep(self, st, valid_LBKT):
        L, B, K, T = valid_LBKT.shape
        b = jnp.sum(super().final_keep(st, valid_LBKT), axis=-1, dtype=jnp.int32)  # LAVa's b_h
        window = jnp.full((L, B, K, self.window), jnp.inf)
        s = jnp.where(valid_LBKT, jnp.concatenate([st["scores"], window], axis=-1), -jnp.inf)
        norm = jnp.pad(st["norm"], [(0, 0)] * 3 + [(0, self.window)])
        r = lambda x: x.reshape((L * B,) + x.shape[2:])
        s2 = critical.two_stage_scores(r(s), r(norm), r(b), T, self.first_stage_ratio,
                                       self.epsilon)
        return critical.top_mask(s2, r(b), T).reshape(L, B, K, T)
