"""LAVa (Shen et al. 2025, LAVa paper Sec. 4; docs/methods.md, "LAVa"): one score for heads
and layers.

Score (Eq. 5): `s_{l,h}[i] = max_k ||V_{l,h}[k]||_1 * mean_{j in window} A^j_{l,h}[i]`,
maxpool 7 along the tokens, max over the GQA group (Sec. 4.3). Window w = 32 forced.
Head budgets: one top-k over the layer's heads x prefix positions (flattened). Layer
budgets (Eq. 6-7): `p = s / sum_{h,i} s`, `e_l = -sum p log p / (H * N)` (H: KV heads,
N: real prefix length); the `T = (B - w) * L * H` prefix entries beyond the windows are
shared as `T * e_l / sum e`, a layer's excess over what it can hold water-filled onto the
others (`kvjax.methods.lava.cascade`).

Cascading (Algorithm 2), as data in the scan carry: after layer l, the budgets of
layers 0..l are recomputed from the stored per-layer ranks/scores and entropies, and
their keep masks ANDed with the new selection (ceilings while cascading, largest
remainder at the last layer, so budgets only shrink). Layer l's kept entries go into a
budget-sized buffer at once; later steps only clear their `valid` bits, so the prefill
holds the buffer and one layer's full K/V, not every layer's (`cascade.Cascading`).
`cascade=False`: all layers prefilled, then budgets in `finalize` (same kept sets).

Options: `heads` ("flat" paper, "uniform" = layer budgets only ablation, "safeguard" =
authors' code), `layers` ("entropy" or "uniform" = head budgets only ablation),
`entropy_norm` ("hn" paper Eq. 7, "log" code: divide by log(H * N)), `vnorm_rows` ("all"
paper Eq. 5: the max over every row k in [N]; "prefix" code: the rows before the window).
Either entropy normalisation is one constant per prompt, so the layer shares (Eq. 7
ratios) are the same.

`lava_code` follows the authors' code (MGDDestiny/Lava; `adaptive_snapkv/monkeypatch/`):
1. the value-norm max over the prefix rows only (`snapkv_utils.py` line 625,
   `value_states[..., :-window_size, :]`);
2. the entropy over `log` of the flattened length (line 635, `np.log(flat.shape[-1])`);
3. per-head layer budgets `int(share * (B - w) * L)` times K at every cascade step
   (`adaptive_mistral_hijack_lava.py` lines 155-160; `snapkv_utils.py` line 762, the
   flattened top-k of `num_heads * base_capacity // groups`), the excess over a layer's
   prefix dropped (line 751: such a layer is not compressed);
4. the safeguard `round(count * (1 - alpha) + int(budget * alpha))` per head (line 769),
   the floor the constant of `LavaKVCluster.__init__` (line 543): the per-layer floor the
   hijack computes (line 161) goes to a misspelt attribute (`floor_capactiy`) nothing
   reads. The kept total is then what that formula gives, not `(B - w) * L * K`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.compression import scoring
from kvjax.compression.heads import Heads
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.lava.cascade import Cascading
from kvjax.methods.registry import register

NORMS = ("hn", "log")
VNORM_ROWS = ("all", "prefix")


def entropy(s_BKP, valid_BP, norm: str, heads: Heads = Heads()):
    """Eq. 6-7: normalised entropy of the layer's scores over heads x real prefix (`heads`
    split: this block's heads, the sums over every block)."""
    K = heads.total(s_BKP.shape[1])
    x = jnp.where(valid_BP[:, None, :], jnp.maximum(s_BKP, 0.0), 0.0)
    p = x / jnp.maximum(heads.sum(jnp.sum(x, axis=(1, 2), keepdims=True)), 1e-30)
    h = -heads.sum(jnp.sum(scoring.plogp(p), axis=(1, 2)))
    N = jnp.sum(valid_BP, axis=-1).astype(jnp.float32)
    if norm == "hn":
        return h / (K * N)
    if norm == "log":  # the authors' code: log of the flattened length, heads x prefix
        return h / jnp.log(jnp.maximum(K * N, 2.0))
    raise ValueError(f"entropy_norm={norm!r}; allowed: {NORMS}")


def lava_scores(io: LayerIO, window: int, kernel: int, pooling: str, vnorm_rows: str = "all"):
    """Eq. 5 [B, K, P]: window attention (mean) x the head's max value L1 norm, pooled,
    max over the GQA group; padding -inf. `vnorm_rows`: the rows the max runs over,
    "all" (Eq. 5, k in [N]) or "prefix" (the authors' code, `snapkv_utils.py` line 625)."""
    valid = io.valid[:, 0]
    a = scoring.window_attention(io.q, io.k, valid, window, "mean")  # [B, K, G, P]
    if vnorm_rows == "all":
        rows = valid
    elif vnorm_rows == "prefix":
        rows = valid & (jnp.arange(valid.shape[1]) < valid.shape[1] - window)
    else:
        raise ValueError(f"vnorm_rows={vnorm_rows!r}; allowed: {VNORM_ROWS}")
    vmax = scoring.max_value_norm(io.v, rows, 1)  # [B, K]
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
    vnorm_rows: str = "all"

    def validate(self, n: int, cfg: ModelConfig) -> None:
        super().validate(n, cfg)
        if self.entropy_norm not in NORMS:
            raise ValueError(f"entropy_norm={self.entropy_norm!r}; allowed: {NORMS}")
        if self.vnorm_rows not in VNORM_ROWS:
            raise ValueError(f"vnorm_rows={self.vnorm_rows!r}; allowed: {VNORM_ROWS}")

    def prefix_scores(self, io: LayerIO):
        return lava_scores(io, self.window, self.kernel, self.pooling, self.vnorm_rows)

    def layer_weight(self, io: LayerIO, s_BKP):
        return entropy(s_BKP, io.valid[:, 0, : s_BKP.shape[-1]], self.entropy_norm, io.heads)


@register
@dataclasses.dataclass(frozen=True)
class LAVaCode(LAVa):
    """LAVa as in the authors' code (MGDDestiny/Lava, module docstring points 1-4): value
    norms over the prefix rows, entropy / log(H * N), per-head `int()` layer budgets times
    K with the excess over a layer's prefix dropped, the safeguard
    `round(count * (1 - alpha) + int(budget * alpha))` with alpha 0.2."""

    name: ClassVar[str] = "lava_code"
    heads: str = "safeguard"
    alpha: float = 0.2
    entropy_norm: str = "log"
    vnorm_rows: str = "prefix"
    rounding: str = "head_floor"
    excess: str = "drop"
    safeguard_floor: str = "constant"


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
