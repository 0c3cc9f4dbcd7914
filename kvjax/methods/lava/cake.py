"""CAKE (Qin et al. 2025) as LAVa's appendix defines it (LAVa paper Eq. 22-24, Table 4).

Eviction indicator (Table 4 form): `s_{l,h}[i] = mean_{j in window} A^j[i] + gamma *
VAR_{j in window}(A^j[i])` over the prefix columns (the window's queries; Eq. 24 writes
the sum and a variance over [i, N], Table 4 the window mean and window variance: the
window is what a layer-by-layer prefill can afford), maxpool 7 as all baselines of
LAVa's tables, GQA mean. Layer preference (Eq. 22-23), `preference`:

- "window" (default): `H_l` = entropy of the window queries' attention rows, `V_l` = sum
  over prefix columns of their variance over the window's queries (both averaged over
  query heads and, for H, queries). The CAKE authors' code also takes the window rows
  (antgroup/cakekv `cake/model/modify_llama.py` lines 105-106);
- "all": Eq. 22 as written: `H_l` sums the entropies of every query row j in [1, N],
  `V_l` sums over every column j the variance of `A^t[j]` over t in [j, N] (averaged
  over query heads and, for H, rows; computed blockwise over queries, two passes).

`P_l = H_l^(1/g1) * V_l^(1/g2)`; budgets shared in proportion to `P_l`, a layer's excess
over its prefix water-filled onto the others, uniform over a layer's heads, cascading as
LAVa (`kvjax.methods.lava.cascade.Cascading`). Variances divide by `n - ddof`; `ddof=1`
(default) as the CAKE authors' `torch.var` (unbiased; `modify_llama.py` lines 106, 114),
`ddof=0` the population variance. In the "window" preference ddof is one constant factor
(same shares); in the score it weighs the variance against the mean.

Defaults (a choice from the grids LAVa's authors searched, App. D: 1/g1, 1/g2 in
{0.2 .. 2}, gamma in {0, 5, 10, 200}): g1 = g2 = 1, gamma = 5.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.compression import scoring
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.lava.cascade import Cascading
from kvjax.methods.registry import register
from kvjax.models import attention

PREFERENCES = ("window", "all")


def window_probs(io: LayerIO, window: int):
    """[B, K, G, w, T] attention of the window queries (fp32 softmax, causal, padding)."""
    q, k, valid = io.q, io.k, io.valid[:, 0]
    B, T = valid.shape
    K = k.shape[1]
    s = attention.logits(q[:, T - window:], k)
    causal = jnp.arange(T)[None, :] <= jnp.arange(T - window, T)[:, None]
    ok = causal[None, None] & valid[:, None, None, :]
    return attention.softmax(s, jnp.broadcast_to(ok, (B, K, window, T)))


def all_rows_preference(io: LayerIO, ddof: int, block: int = 256):
    """Eq. 22 over every query row, [B] each: (mean over query heads and real rows of the
    row's attention entropy, mean over query heads of the sum over real columns j of
    VAR_{t in [j, N]} A^t[j]). Two blockwise passes over the queries (the column means,
    then the centred squares), so at most [B, H, block, T] exists at a time; a column
    with at most `ddof` rows at or after it has variance 0."""
    B, T = io.valid.shape[0], io.valid.shape[2]
    K, H = io.k.shape[1], io.q.shape[2]  # this block's heads (`io.heads`)
    G = H // K
    qvalid = io.valid[:, 0] if io.qvalid is None else io.qvalid
    args = (io.q, io.k, io.qpos, qvalid, io.pos, io.valid)

    def first(c, p, ok, v):
        ent, s1, n = c
        rows = v[:, None, None, :, None]
        e = -jnp.sum(scoring.plogp(p), axis=-1)
        ent = ent + jnp.sum(jnp.where(v[:, None, None, :], e, 0.0), axis=(1, 2, 3))
        s1 = s1 + jnp.sum(jnp.where(rows, p, 0.0), axis=3)
        n = n + jnp.sum(ok & v[:, None, :, None], axis=2, dtype=jnp.int32)
        return ent, s1, n

    zeros = jnp.zeros((B, K, G, T), jnp.float32)
    init = (jnp.zeros((B,), jnp.float32), zeros, jnp.zeros((B, K, T), jnp.int32))
    ent, s1, n = scoring.fold_query_blocks(first, init, *args, block=block, lse_BKGT=io.lse)
    nf = n[:, :, None, :].astype(jnp.float32)
    mean = s1 / jnp.maximum(nf, 1.0)

    def second(c, p, ok, v):
        d = jnp.where((ok & v[:, None, :, None])[:, :, None], p - mean[:, :, :, None, :], 0.0)
        return c + jnp.sum(d * d, axis=3)

    s2 = scoring.fold_query_blocks(second, zeros, *args, block=block, lse_BKGT=io.lse)
    var = jnp.where(nf > ddof, s2 / jnp.maximum(nf - ddof, 1.0), 0.0)
    var = jnp.where(io.valid[:, :, None, :], var, 0.0)
    n_real = jnp.sum(qvalid, axis=-1).astype(jnp.float32)
    return (io.heads.sum(ent) / (io.heads.total(H) * jnp.maximum(n_real, 1.0)),
            io.heads.mean(jnp.sum(var, axis=-1), (1, 2)))


@register
@dataclasses.dataclass(frozen=True)
class CAKE(Cascading):
    """CAKE: window mean + gamma * window variance scores (maxpool 7, GQA mean); layer
    budgets by preference H^(1/g1) * V^(1/g2) (Eq. 23; rows: `preference`), uniform heads,
    cascading."""

    name: ClassVar[str] = "cake"
    heads: str = "uniform"
    gamma: float = 5.0
    gamma1: float = 1.0
    gamma2: float = 1.0
    preference: str = "window"
    ddof: int = 1

    def validate(self, n: int, cfg: ModelConfig) -> None:
        for f in ("gamma1", "gamma2"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f}={getattr(self, f)} is a temperature (P = H^(1/gamma1) * "
                                 f"V^(1/gamma2)); allowed: {f} > 0")
        if self.gamma < 0:
            raise ValueError(f"gamma={self.gamma}; allowed: gamma >= 0")
        if self.preference not in PREFERENCES:
            raise ValueError(f"preference={self.preference!r}; allowed: {PREFERENCES}")
        if self.ddof not in (0, 1):
            raise ValueError(f"ddof={self.ddof}; allowed: 0 (population variance), 1 "
                             "(unbiased, the CAKE authors' torch.var)")
        if self.window <= self.ddof:
            raise ValueError(f"window={self.window}: a variance over the window's queries "
                             f"with ddof={self.ddof} needs window > {self.ddof}")
        super().validate(n, cfg)

    def _probs(self, io):
        return window_probs(io, self.window)

    def prefix_scores(self, io: LayerIO):
        valid = io.valid[:, 0]
        p = self._probs(io)[..., : valid.shape[1] - self.window]  # [B, K, G, w, P]
        s = jnp.mean(p, axis=3) + self.gamma * jnp.var(p, axis=3, ddof=self.ddof)
        s = scoring.gqa_reduce(scoring.pool1d(s, self.kernel, self.pooling), "mean")
        return scoring.mask_padding(s, valid[:, : s.shape[-1]])

    def layer_weight(self, io: LayerIO, s_BKP):
        if self.preference == "all":
            H, V = all_rows_preference(io, self.ddof)
        else:
            valid = io.valid[:, 0]
            p = self._probs(io)
            H = -jnp.sum(scoring.plogp(p), axis=-1)
            H = io.heads.mean(H, (1, 2, 3))  # [B]
            pp = p[..., : valid.shape[1] - self.window]
            V = io.heads.mean(jnp.sum(jnp.var(pp, axis=3, ddof=self.ddof), axis=-1), (1, 2))
        return H ** (1.0 / self.gamma1) * V ** (1.0 / self.gamma2)
