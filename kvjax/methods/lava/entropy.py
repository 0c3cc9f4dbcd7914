"""LAVa (Shen et al. 2025, LAVa paper Sec. 4; docs/methods.md, "LAVa"): one score for heads
and layers.

Score (Eq. 5): `s_{l,h}[i] = max_k ||V_{l,h}[k]||_1 * mean_{j in window} A^j_{l,h}[i]`,
maxpool 7 along the tokens, max over the GQA group (Sec. 4.3). Window w = 32 forced.
Head budgets: one top-k over the layer's heads x prefix positions (flattened). Layer
budgets (Eq. 6-7): `p = s / sum_{h,i} s`, `e_l = -sum p log p / (H * N)` (H: KV heads,
N: real prefix length); the `T = (B - w) * L * H` prefix entries beyond the windows are
shared as `T * e_l / sum e`.

Cascading (Algorithm 2), as data in the scan carry: after layer l, the budgets of
layers 0..l are recomputed from the stored per-layer ranks/scores and entropies, and
their keep masks ANDed with the new selection (`kvjax.methods.lava.cascade`: ceilings while
cascading, largest remainder at the last layer, so budgets only shrink). The live-entry
count is measured from the carry's masks at every step (`peak_live_kv_bytes`). The KV
itself is kept full-length in the scan output and gathered into the static slots in
`finalize`: "live" KV is what the masks keep; the physical buffer during the scan is the
full prompt (a fixed-shape masked cache, docs/design.md "The cache").
`cascade=False`: all layers prefilled, then budgets in `finalize` (same kept sets).

Options: `heads` ("flat" paper, "uniform" = layer budgets only ablation, "safeguard" =
authors' code), `layers` ("entropy" or "uniform" = head budgets only ablation),
`entropy_norm` ("hn" paper Eq. 7, "log" code: divide by log N). Note that either
normalisation is one constant per prompt, so the layer shares (Eq. 7 ratios) are the same.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.compress import scoring
from kvjax.compress.layer import LayerIO
from kvjax.methods.lava.cascade import Cascading
from kvjax.methods.registry import register

NORMS = ("hn", "log")


def entropy(s_BKP, valid_BP, norm: str):
    """Eq. 6-7: normalised entropy of the layer's scores over heads x real prefix."""
    K = s_BKP.shape[1]
    x = jnp.where(valid_BP[:, None, :], jnp.maximum(s_BKP, 0.0), 0.0)
    p = x / jnp.maximum(jnp.sum(x, axis=(1, 2), keepdims=True), 1e-30)
    h = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=(1, 2))
    N = jnp.sum(valid_BP, axis=-1).astype(jnp.float32)
    if norm == "hn":
        return h / (K * N)
    if norm == "log":
        return h / jnp.log(jnp.maximum(N, 2.0))
    raise ValueError(f"entropy_norm={norm!r}; allowed: {NORMS}")


def lava_scores(io: LayerIO, window: int, kernel: int, pooling: str):
    """Eq. 5 [B, K, P]: window attention (mean) x the head's max value L1 norm, pooled,
    max over the GQA group; padding -inf."""
    valid = io.valid[:, 0]
    a = scoring.window_attention(io.q, io.k, valid, window, "mean")  # [B, K, G, P]
    vmax = scoring.max_value_norm(io.v, valid, 1)  # [B, K]
    s = scoring.gqa_reduce(scoring.pool1d(a * vmax[:, :, None, None], kernel, pooling), "max")
    return scoring.mask_padding(s, valid[:, : s.shape[-1]])


@register
@dataclasses.dataclass(frozen=True)
class LAVa(Cascading):
    """LAVa: Eq. 5 scores (window 32, maxpool 7, GQA max), flattened head budgets, entropy
    layer budgets (Eq. 7, /(H*N)), cascading in the prefill. Ablations:
    `layers=uniform` (head budgets only), `heads=uniform` (layer budgets only)."""

    name: ClassVar[str] = "lava"
    entropy_norm: str = "hn"

    def prefix_scores(self, io: LayerIO):
        return lava_scores(io, self.window, self.kernel, self.pooling)

    def layer_weight(self, io: LayerIO, s_BKP):
        return entropy(s_BKP, io.valid[:, 0, : s_BKP.shape[-1]], self.entropy_norm)


@register
@dataclasses.dataclass(frozen=True)
class LAVaCode(LAVa):
    """LAVa as in the authors' code (MGDDestiny/Lava): entropy divided by log N, head
    counts with a safeguard alpha 0.2 (`round(count * (1 - alpha)) + floor`, the floor
    from the layer's budget, not the code's constant)."""

    name: ClassVar[str] = "lava_code"
    heads: str = "safeguard"
    alpha: float = 0.2
    entropy_norm: str = "log"


@register
@dataclasses.dataclass(frozen=True)
class LAVaHeadBudgets(LAVa):
    """LAVa ablation "head budgets only": uniform layer budgets, flattened heads."""

    name: ClassVar[str] = "lava_heads_only"
    layers: str = "uniform"


@register
@dataclasses.dataclass(frozen=True)
class LAVaLayerBudgets(LAVa):
    """LAVa ablation "layer budgets only": entropy layer budgets, uniform heads."""

    name: ClassVar[str] = "lava_layers_only"
    heads: str = "uniform"
