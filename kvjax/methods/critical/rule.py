"""CriticalKV (Feng et al. 2025, CriticalKV paper Algorithm 1) as a selection rule that wraps
a base method: `Critical(base=...)` keeps the base's per-head budgets b and replaces *which*
entries fill them -- stage 1 keeps the top `int(first_stage_ratio * b)` by the base's
attention score, stage 2 fills the rest by `(score + epsilon) * mean_g ||v_i W_O^h||_1`
(`projected_norms`); the window (+inf) is always kept. The layer's W_O reaches the rule
through `LayerIO.wo`.

Any base that selects per head by scores composes: the SnapKV family (its
`evict_layer(io, state, choose)`), HeadKV, and the cascading LAVa/CAKE (whose final counts
come from their masks, `Cascading.select_final`). Registered names (kept for the CLI):
`critical_snapkv` (kvpress `CriticalKVPress(SnapKVPress)`), `critical_pyramidkv`
(PyramidKV's per-layer b), `critical_adakv` (kvpress `CriticalAdaKVPress`: AdaKV's
flattened head budgets with its 0.2 safeguard decide b_h, the safeguard entries join
stage 1), `critical_headkv` (HeadKV's static b_h; the paper's third integration, Sec. 5)
and `critical_lava` (LAVa's per-head counts after its head and layer allocation, then the
two stages on LAVa's own Eq. 5 score; in neither paper, docs/methods.md "CriticalKV").
Defaults first_stage_ratio 0.5, epsilon 1e-4 (paper and kvpress).

One deliberate difference from kvpress: kvjax forces the window (+inf), kvpress scores it
`max + 1` and keeps it only where stage 1 (or AdaKV's safeguard) covers it, i.e. when
`int(0.5 b) >= window`; the two agree whenever that holds.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, ClassVar

import jax.numpy as jnp

from kvjax import pallas
from kvjax.compression import selection
from kvjax.compression.eviction import HeadBudgets
from kvjax.compression.layer import LayerIO
from kvjax.compression.method import Method
from kvjax.compression.protocols import FinalSelection, ScoredEviction
from kvjax.compression.wrapper import Wrapper
from kvjax.config import ModelConfig
from kvjax.methods.critical import projected_norms
from kvjax.methods.baselines.headkv import HeadKV
from kvjax.methods.registry import register_wrapped
from kvjax.methods.baselines.snapkv import SnapKV

# registered names of the wrapped bases (the records' method names)
NAMES = {"snapkv": "critical_snapkv", "pyramidkv": "critical_pyramidkv",
         "ada_snapkv": "critical_adakv", "headkv": "critical_headkv", "lava": "critical_lava"}


@dataclasses.dataclass(frozen=True)
class Critical(Wrapper):
    """CriticalKV's two-stage selection at the base method's per-head budgets; every other
    hook is the base's (`Wrapper`)."""

    base: Method = SnapKV()
    first_stage_ratio: float = projected_norms.ALPHA
    epsilon: float = projected_norms.EPS
    norm_block: int = 256

    positional: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return NAMES.get(self.base.name, f"critical({self.base.name})")

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if not isinstance(self.base, (ScoredEviction, FinalSelection)) or \
                self.base.uses_decode_layer():
            raise ValueError(f"critical: base={self.base.name!r} does not select per head by "
                             "scores at prefill; allowed: the SnapKV family, HeadKV, LAVa, CAKE")
        self.base.validate(n, cfg)
        if not 0 <= self.first_stage_ratio <= 1:
            raise ValueError(f"first_stage_ratio={self.first_stage_ratio} outside [0, 1]")
        if self.epsilon < 0:
            raise ValueError(f"epsilon={self.epsilon} must be >= 0")

    def splits_heads(self) -> bool:
        # the rule reads the whole layer's W_O (`LayerIO.wo`), which a per-device block of
        # heads does not slice: XLA partitions it instead
        return False

    @property
    def _at_finalize(self) -> bool:
        """Whether the base decides its counts after the scan (cascading LAVa/CAKE)."""
        return isinstance(self.base, FinalSelection)

    def init_state(self, cfg: ModelConfig, batch: int, n: int):
        st = self.base.init_state(cfg, batch, n)
        if not self._at_finalize:
            return st
        P = n - self.base.window
        return {"base": st, "norm": jnp.zeros((cfg.num_layers, batch, cfg.num_kv_heads, P))}

    def after_layer_prefill(self, io: LayerIO, state: Any):
        if not self._at_finalize:
            return self.base.evict_layer(io, state, self.choose)
        kv, aux, st = self.base.after_layer_prefill(io, state["base"])
        P = state["norm"].shape[-1]
        norm = state["norm"].at[io.layer].set(self.projected_norms(io)[..., :P])
        return kv, aux, {"base": st, "norm": norm}

    def finalize(self, kv, aux, state: Any):
        if not self._at_finalize:
            return self.base.finalize(kv, aux, state)
        L, B, K, P = state["norm"].shape
        norm = jnp.pad(state["norm"], [(0, 0)] * 3 + [(0, self.base.window)])
        return self.base.select_final(kv, state["base"], partial(
            self.choose, norm_BKT=norm.reshape(L * B, K, -1)))

    # ---- the rule -------------------------------------------------------------------------

    def projected_norms(self, io: LayerIO):
        if io.wo is None:
            raise ValueError(f"{self.name}: the layer's W_O is missing from LayerIO (CriticalKV "
                             "scores with the output projection; only the prefill passes it)")
        return pallas.value_norms(io.v, io.wo, block=self.norm_block,
                                  implementation=io.kernels.value_norms)

    def choose(self, io: LayerIO | None, s_BKT, hb: HeadBudgets, S: int, norm_BKT=None):
        """Algorithm 1 at the counts `hb.count`: stage-1 entries (and the base's `first`,
        AdaKV's safeguard) at +inf, the rest by (s + eps) * norm, top count per head."""
        norm = self.projected_norms(io) if norm_BKT is None else norm_BKT
        s2 = projected_norms.two_stage_scores(s_BKT, norm, hb.count, S, self.first_stage_ratio,
                                              self.epsilon, hb.first)
        return selection.slots_from_scores(s2, hb.count, S)


for _base, _name in NAMES.items():
    register_wrapped(_name, Critical, _base)

__all__ = ["Critical", "HeadKV"]
