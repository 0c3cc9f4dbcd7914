"""LAVa (lava.txt Sec. 4; METHODS.md section 3): one score for heads and layers.

Score (Eq. 5): `s_{l,h}[i] = max_k ||V_{l,h}[k]||_1 * mean_{j in window} A^j_{l,h}[i]`,
maxpool 7 along the tokens, max over the GQA group (Sec. 4.3). Window w = 32 forced.
Head budgets: one top-k over the layer's heads x prefix positions (flattened). Layer
budgets (Eq. 6-7): `p = s / sum_{h,i} s`, `e_l = -sum p log p / (H * N)` (H: KV heads,
N: real prefix length); the `T = (B - w) * L * H` prefix entries beyond the windows are
shared as `T * e_l / sum e`.

Cascading (Algorithm 2), as data in the scan carry: after layer l, the budgets of
layers 0..l are recomputed from the stored per-layer ranks/scores and entropies, and
their keep masks ANDed with the new selection (`kvjax.layer_budgets`: ceilings while
cascading, largest remainder at the last layer, so budgets only shrink). The live-entry
count is measured from the carry's masks at every step (`peak_live_kv_bytes`). The KV
itself is kept full-length in the scan output and gathered into the static slots in
`finalize`: "live" KV is what the masks keep; the physical buffer during the scan is the
full prompt (a fixed-shape masked cache, ARCHITECTURE.md section 3).
`cascade=False`: all layers prefilled, then budgets in `finalize` (same kept sets).

Options: `heads` ("flat" paper, "uniform" = layer budgets only ablation, "safeguard" =
authors' code), `layers` ("entropy" or "uniform" = head budgets only ablation),
`entropy_norm` ("hn" paper Eq. 7, "log" code: divide by log N). Note that either
normalisation is one constant per prompt, so the layer shares (Eq. 7 ratios) are the same.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import layer_budgets as lb
from kvjax import scoring, select
from kvjax.config import ModelConfig
from kvjax.methods import register
from kvjax.methods.eviction import PrefillEviction, real_length
from kvjax.models.transformer import LayerIO

HEADS = ("flat", "uniform", "safeguard")
LAYERS = ("entropy", "uniform")
NORMS = ("hn", "log")


@dataclasses.dataclass(frozen=True)
class Cascading(PrefillEviction):
    """Shared core: per-layer prefix scores and a layer weight, budgets by cascade."""

    name: ClassVar[str] = "_cascading"
    budget: int = 128
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    heads: str = "flat"
    layers: str = "entropy"
    cascade: bool = True
    alpha: float = 0.0

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if self.budget <= self.window:
            raise ValueError(
                f"budget={self.budget} cannot hold the window ({self.window} entries) of every "
                f"layer and head; allowed: window {self.window} < budget <= prompt length {n}")
        super().validate(n, cfg)
        if self.heads not in HEADS:
            raise ValueError(f"heads={self.heads!r}; allowed: {HEADS}")
        if self.layers not in LAYERS:
            raise ValueError(f"layers={self.layers!r}; allowed: {LAYERS}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha} outside [0, 1]")

    # ---- shapes -----------------------------------------------------------------------

    def kept_slots(self, n: int) -> int:
        return n

    def slots(self, n: int, L: int, K: int) -> int:
        # one head may take every prefix entry of the total budget beyond the windows
        return int(min(n, self.window + (self.budget - self.window) * L * K))

    def cache_slots(self, n: int, cfg: ModelConfig) -> int:
        return self.slots(n, cfg.num_layers, cfg.num_kv_heads)

    # ---- per layer: scores and weight ---------------------------------------------------

    def prefix_scores(self, io: LayerIO):
        """[B, K, P] scores of the prefix columns (padding -inf)."""
        raise NotImplementedError

    def layer_weight(self, io: LayerIO, s_BKP) -> jnp.ndarray:
        """[B] this layer's share weight (entropy, preference)."""
        raise NotImplementedError

    # ---- carry ------------------------------------------------------------------------

    def init_state(self, cfg: ModelConfig, batch: int, n: int):
        L, K, P = cfg.num_layers, cfg.num_kv_heads, n - self.window
        return dict(
            scores=jnp.zeros((L, batch, K, P), jnp.float32),
            frank=jnp.zeros((L, batch, K, P), jnp.int32),
            hrank=jnp.zeros((L, batch, K, P), jnp.int32),
            weight=jnp.zeros((L, batch), jnp.float32),
            budget=jnp.full((L, batch), jnp.iinfo(jnp.int32).max, jnp.int32),
            keep=jnp.ones((L, batch, K, P), bool),
            shrank=jnp.ones((), bool),
            peak=jnp.zeros((batch,), jnp.int32),
        )

    def _budgets(self, st, active, total, cap, final):
        if self.layers == "uniform":
            w = jnp.ones_like(st["weight"])
        else:
            w = st["weight"]
        return lb.allocate(w, active, total, cap, final)

    def _masks(self, st, budget_LB):
        def one(fr, hr, b):
            return lb.prefix_keep(fr, hr, b, self.heads, self.alpha)
        return jax.vmap(one)(st["frank"], st["hrank"], budget_LB)

    def _totals(self, io: LayerIO, L: int):
        K = io.k.shape[1]
        P_real = real_length(io) - self.window  # [B]
        total = jnp.full_like(P_real, (self.budget - self.window) * L * K)
        return total, K * P_real

    def after_layer_prefill(self, io: LayerIO, st):
        L = st["weight"].shape[0]
        l = io.layer
        s = self.prefix_scores(io)
        w = self.layer_weight(io, s)
        st = dict(st)
        st["scores"] = st["scores"].at[l].set(s)
        st["frank"] = st["frank"].at[l].set(lb.flat_rank(s))
        st["hrank"] = st["hrank"].at[l].set(lb.head_rank(s))
        st["weight"] = st["weight"].at[l].set(w)
        if self.cascade:
            K = io.k.shape[1]
            n_real = real_length(io)
            layers = jnp.arange(L)
            before = layers < l
            live_before = jnp.sum(jnp.where(before[:, None], self._live(st, io), 0), axis=0)
            st["peak"] = jnp.maximum(st["peak"], live_before + K * n_real)
            total, cap = self._totals(io, L)
            raw = self._budgets(st, layers <= l, total, cap, l == L - 1)
            # the claim "budgets only shrink", checked on the raw recomputed budgets
            st["shrank"] = st["shrank"] & jnp.all(jnp.where(before[:, None], raw <= st["budget"], True))
            b = jnp.where((layers <= l)[:, None], jnp.minimum(raw, st["budget"]), st["budget"])
            st["budget"] = b
            st["keep"] = st["keep"] & self._masks(st, b)
        return (io.k, io.v, io.pos, io.valid), st

    def _live(self, st, io_or_valid):
        """[L, B] live entries per layer (window included) under the current masks."""
        K, w = st["keep"].shape[2], self.window
        valid = io_or_valid.valid[:, 0] if isinstance(io_or_valid, LayerIO) else io_or_valid
        P = st["keep"].shape[-1]
        pv = valid[:, :P]
        prefix = jnp.sum(st["keep"] & pv[None, :, None, :], axis=(2, 3))
        return (prefix + K * w).astype(jnp.int32)

    def finalize(self, kv, st):
        k, v, pos, valid = kv  # [L, B, K, T, D], valid [L, B, K, T]
        L, B, K, T = valid.shape
        valid_BT = valid[0, :, 0]
        st = dict(st)
        if not self.cascade:
            n_real = jnp.sum(valid_BT, axis=-1, dtype=jnp.int32)
            P_real = n_real - self.window
            total = jnp.full_like(P_real, (self.budget - self.window) * L * K)
            b = self._budgets(st, jnp.ones((L,), bool), total, K * P_real, True)
            st["budget"] = b
            st["keep"] = self._masks(st, b)
            st["peak"] = L * K * n_real
        keep = self.final_keep(st, valid)
        S = self.slots(T, L, K)
        idx, live = select.slots_from_mask(keep.reshape(L * B, K, T), S)
        r = lambda x: x.reshape((L * B,) + x.shape[2:])
        out = select.gather(r(k), r(v), r(pos), r(valid), idx, live)
        out = tuple(x.reshape((L, B) + x.shape[1:]) for x in out)
        per_entry = 2 * k.shape[-1] * k.dtype.itemsize
        live_LBK = jnp.sum(out[3], axis=-1, dtype=jnp.int32)
        stats = {
            "layer_budgets": jnp.moveaxis(live_LBK, 1, 0),  # [B, L, K]
            "layer_weight": st["weight"].T,  # [B, L] entropy (LAVa) / preference (CAKE)
            "peak_live_kv_bytes": st["peak"] * per_entry,
            "live_kv_bytes": jnp.sum(live_LBK, axis=(0, 2)) * per_entry,
            "allocated_kv_bytes": jnp.full((B,), L * K * S * per_entry),
            "full_kv_bytes": jnp.sum(valid[0, :, 0], axis=-1) * L * K * per_entry,
            "budgets_shrank": jnp.broadcast_to(st["shrank"], (B,)),
        }
        return out, None, stats

    def final_keep(self, st, valid_LBKT):
        """[L, B, K, T] the final keep masks: the budgets' prefix masks plus the window.
        A hook for rules that keep these per-head counts but choose others (critical_lava)."""
        L, B, K, _ = st["keep"].shape
        window = jnp.ones((L, B, K, self.window), bool)
        return jnp.concatenate([st["keep"], window], axis=-1) & valid_LBKT


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
