"""CAKE (Qin et al. 2025) as LAVa's appendix defines it (LAVa paper Eq. 22-24, Table 4).

Eviction indicator (Table 4 form): `s_{l,h}[i] = mean_{j in window} A^j[i] + gamma *
VAR_{j in window}(A^j[i])` over the prefix columns (the window's queries; Eq. 24 writes
the sum and a variance over [i, N], Table 4 the window mean and window variance: the
window is what a layer-by-layer prefill can afford), maxpool 7 as all baselines of
LAVa's tables, GQA mean. Layer preference (Eq. 22-23): `H_l` = entropy of the window's
attention rows, `V_l` = sum over prefix columns of their variance over the window's
queries (both averaged over query heads and, for H, queries), `P_l = H_l^(1/g1) *
V_l^(1/g2)`; budgets shared in proportion to `P_l`, uniform over a layer's heads,
cascading as LAVa (`kvjax.methods.lava.cascade.Cascading`).

Defaults (a choice from the grids LAVa's authors searched, App. C: 1/g1, 1/g2 in
{0.2 .. 2}, gamma in {0, 5, 10, 200}): g1 = g2 = 1, gamma = 5.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.compress import scoring
from kvjax.compress.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.lava.cascade import Cascading
from kvjax.methods.registry import register
from kvjax.models import attention


def window_probs(io: LayerIO, window: int):
    """[B, K, G, w, T] attention of the window queries (fp32 softmax, causal, padding)."""
    q, k, valid = io.q, io.k, io.valid[:, 0]
    B, T = valid.shape
    K = k.shape[1]
    s = attention.logits(q[:, T - window:], k)
    causal = jnp.arange(T)[None, :] <= jnp.arange(T - window, T)[:, None]
    ok = causal[None, None] & valid[:, None, None, :]
    return attention.softmax(s, jnp.broadcast_to(ok, (B, K, window, T)))


@register
@dataclasses.dataclass(frozen=True)
class CAKE(Cascading):
    """CAKE: window mean + gamma * window variance scores (maxpool 7, GQA mean); layer
    budgets by preference H^(1/g1) * V^(1/g2) (Eq. 23), uniform heads, cascading."""

    name: ClassVar[str] = "cake"
    heads: str = "uniform"
    gamma: float = 5.0
    gamma1: float = 1.0
    gamma2: float = 1.0

    def validate(self, n: int, cfg: ModelConfig) -> None:
        for f in ("gamma1", "gamma2"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f}={getattr(self, f)} is a temperature (P = H^(1/gamma1) * "
                                 f"V^(1/gamma2)); allowed: {f} > 0")
        if self.gamma < 0:
            raise ValueError(f"gamma={self.gamma}; allowed: gamma >= 0")
        super().validate(n, cfg)

    def _probs(self, io):
        return window_probs(io, self.window)

    def prefix_scores(self, io: LayerIO):
        valid = io.valid[:, 0]
        p = self._probs(io)[..., : valid.shape[1] - self.window]  # [B, K, G, w, P]
        s = jnp.mean(p, axis=3) + self.gamma * jnp.var(p, axis=3)
        s = scoring.gqa_reduce(scoring.pool1d(s, self.kernel, self.pooling), "mean")
        return scoring.mask_padding(s, valid[:, : s.shape[-1]])

    def layer_weight(self, io: LayerIO, s_BKP):
        valid = io.valid[:, 0]
        p = self._probs(io)
        H = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
        H = jnp.mean(H, axis=(1, 2, 3))  # [B]
        pp = p[..., : valid.shape[1] - self.window]
        V = jnp.mean(jnp.sum(jnp.var(pp, axis=3), axis=-1), axis=(1, 2))  # [B]
        return H ** (1.0 / self.gamma1) * V ** (1.0 / self.gamma2)
