"""Data-dependent layer budgets and cascading (LAVa Algorithm 2, CAKE Eq. 23).

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

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


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
