"""Data-dependent layer budgets and cascading (LAVa Algorithm 2, CAKE Eq. 23), and
`Cascading`, the base LAVa and CAKE share.

A total of `total` prefix entries (beyond the windows) is shared by the layers in
proportion to a per-layer weight (LAVa: entropy Eq. 7; CAKE: preference Eq. 23). Budgets
are counted in entries over all KV heads of a layer (a layer keeps `K * w` window entries
plus its budget).

Rounding (a choice; the paper uses real numbers): the final allocation is largest
remainder (floors, then +1 to the largest fractional parts, ties to the lower layer), so
it sums to `total` exactly unless a layer's cap (its `K * P` prefix entries) binds (the
excess is then dropped, not redistributed). While cascading, intermediate budgets are
ceilings, and `min` with the previous budget: each is >= the final largest-remainder
budget (final weights share is never larger), so budgets only shrink and the kept sets
of the cascading and non-cascading forms are equal.

Everything here is jnp on traced arrays (used inside the prefill scan).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.compress import selection
from kvjax.compress.eviction import Chooser, HeadBudgets, PrefillEviction, real_length
from kvjax.compress.layer import LayerIO, LayerKV
from kvjax.config import ModelConfig

HEADS = ("flat", "uniform", "safeguard")
LAYERS = ("entropy", "uniform")


def allocate(weights_LB: Float[Array, "L B"], active_L: Bool[Array, "L"], total_B: Int[Array, "B"],
             cap_B: Int[Array, "B"], final) -> Int[Array, "L B"]:
    """Budgets [L, B] of the active layers (0 elsewhere): `total * w_l / sum_active w`,
    largest remainder where `final` (a traced bool is fine), ceilings otherwise; capped."""
    w = jnp.where(active_L[:, None], jnp.maximum(weights_LB, 0.0), 0.0)
    denom = jnp.sum(w, axis=0, keepdims=True)
    n_active = jnp.maximum(jnp.sum(active_L), 1)
    # all weights zero: share uniformly among the active layers
    share = jnp.where(denom > 0, w / jnp.where(denom > 0, denom, 1.0),
                      active_L[:, None] / n_active)
    x = share * total_B[None, :].astype(jnp.float32)
    base = jnp.floor(x)
    rem = total_B - jnp.sum(base, axis=0).astype(jnp.int32)  # [B]
    frac = jnp.where(active_L[:, None], x - base, -1.0)
    order = jnp.argsort(-frac, axis=0, stable=True)
    rank = jnp.argsort(order, axis=0, stable=True)
    lr = base.astype(jnp.int32) + (rank < rem[None, :]).astype(jnp.int32)
    ceil = jnp.ceil(x).astype(jnp.int32)
    b = jnp.where(final, lr, ceil)
    return jnp.where(active_L[:, None], jnp.minimum(b, cap_B[None, :]), 0)


def flat_rank(s_BKP: Float[Array, "B K P"]) -> Int[Array, "B K P"]:
    """Rank of every entry in one order over heads x positions (best 0; ties: lower flat
    index first, as `lax.top_k`)."""
    B, K, P = s_BKP.shape
    order = jnp.argsort(-s_BKP.reshape(B, K * P), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    return rank.reshape(B, K, P).astype(jnp.int32)


def head_rank(s_BKP: Float[Array, "B K P"]) -> Int[Array, "B K P"]:
    """Rank of every entry within its head (best 0; ties: lower position first)."""
    order = jnp.argsort(-s_BKP, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def prefix_keep(frank_BKP, hrank_BKP, budget_B, mode: str, alpha: float = 0.0):
    """Keep mask [B, K, P] of the prefix for a layer budget `budget_B` (entries over heads).

    mode "flat": one top-budget over heads x positions (LAVa Sec. 4.1, AdaKV);
    "uniform": every head keeps budget // K (the first budget % K heads one more);
    "safeguard": LAVa code variant -- flattened counts mixed with a uniform floor,
    `round(count * (1 - alpha)) + floor(budget / K * alpha)` per head (floor from this
    layer's budget, not the code's constant); totals may differ from `budget` by rounding.
    """
    K = frank_BKP.shape[1]
    b = budget_B[:, None, None]
    if mode == "flat":
        return frank_BKP < b
    if mode == "uniform":
        h = jnp.arange(K)[None, :, None]
        per = b // K + (h < b % K)
        return hrank_BKP < per
    if mode == "safeguard":
        count = jnp.sum(frank_BKP < b, axis=-1, keepdims=True).astype(jnp.float32)
        floor = jnp.floor(b.astype(jnp.float32) / K * alpha)
        per = (jnp.round(count * (1 - alpha)) + floor).astype(jnp.int32)
        return hrank_BKP < per
    raise ValueError(f"head mode={mode!r}; allowed: 'flat', 'uniform', 'safeguard'")


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
        return allocate(w, active, total, cap, final)

    def _masks(self, st, budget_LB):
        def one(fr, hr, b):
            return prefix_keep(fr, hr, b, self.heads, self.alpha)
        return jax.vmap(one)(st["frank"], st["hrank"], budget_LB)

    def _totals(self, io: LayerIO, L: int):
        K = io.k.shape[1]
        P_real = real_length(io) - self.window  # [B]
        total = jnp.full_like(P_real, (self.budget - self.window) * L * K)
        return total, K * P_real

    def after_layer_prefill(self, io: LayerIO, st):
        """Stores the layer's scores, ranks and weight; cascading: recomputes the budgets
        of layers 0..l and shrinks their keep masks."""
        L = st["weight"].shape[0]
        l = io.layer
        s = self.prefix_scores(io)
        w = self.layer_weight(io, s)
        st = dict(st)
        st["scores"] = st["scores"].at[l].set(s)
        st["frank"] = st["frank"].at[l].set(flat_rank(s))
        st["hrank"] = st["hrank"].at[l].set(head_rank(s))
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
        return io.kv, None, st

    def _live(self, st, io_or_valid):
        """[L, B] live entries per layer (window included) under the current masks."""
        K, w = st["keep"].shape[2], self.window
        valid = io_or_valid.valid[:, 0] if isinstance(io_or_valid, LayerIO) else io_or_valid
        P = st["keep"].shape[-1]
        pv = valid[:, :P]
        prefix = jnp.sum(st["keep"] & pv[None, :, None, :], axis=(2, 3))
        return (prefix + K * w).astype(jnp.int32)

    def finalize(self, kv: LayerKV, aux, st):
        return self.select_final(kv, st, None)

    def select_final(self, kv: LayerKV, st, choose: Chooser | None):
        """The final budgets, keep masks and compaction; `choose` (a wrapper's selection
        rule, e.g. CriticalKV) picks which entries each head keeps at the counts of its
        final mask, None keeps the mask itself."""
        k, valid = kv.k, kv.valid  # [L, B, K, T, D], [L, B, K, T]
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
        r = lambda x: x.reshape((L * B,) + x.shape[2:])  # noqa: E731
        if choose is None:
            idx, live = selection.slots_from_mask(r(keep), S)
        else:
            window = jnp.full((L, B, K, self.window), jnp.inf)
            s = jnp.where(valid, jnp.concatenate([st["scores"], window], axis=-1), -jnp.inf)
            count = jnp.sum(keep, axis=-1, dtype=jnp.int32)
            idx, live = choose(None, r(s), HeadBudgets(r(count)), S)
        out = selection.compact(jax.tree.map(r, kv), idx, live)
        out = jax.tree.map(lambda x: x.reshape((L, B) + x.shape[1:]), out)
        per_entry = 2 * k.shape[-1] * k.dtype.itemsize
        live_LBK = jnp.sum(out.valid, axis=-1, dtype=jnp.int32)
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
        """[L, B, K, T] the final keep masks: the budgets' prefix masks plus the window."""
        L, B, K, _ = st["keep"].shape
        window = jnp.ones((L, B, K, self.window), bool)
        return jnp.concatenate([st["keep"], window], axis=-1) & valid_LBKT
