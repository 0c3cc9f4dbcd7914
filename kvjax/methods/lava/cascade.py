"""Data-dependent layer budgets and cascading (LAVa Algorithm 2, CAKE Eq. 23), and
`Cascading`, the base LAVa and CAKE share (docs/methods.md, "LAVa").

A total of `total` prefix entries (beyond the windows) is shared by the layers in
proportion to a per-layer weight (LAVa: entropy Eq. 7; CAKE: preference Eq. 23). Budgets
are counted in entries over all KV heads of a layer (a layer keeps `K * w` window entries
plus its budget).

Caps and water-filling (`excess="refill"`, the default): a layer holds at most its `K * P`
prefix entries (fewer under `head_cap`, below). The LAVa paper's shares (Algorithm 2,
line 10; Eq. 23 for CAKE) have no cap, so the share a layer cannot hold goes to the
others: budgets are `min(cap_l, lam * w_l)` with the level `lam` set so that they sum to
`total` (all layers capped when their caps sum to less).
Adding a layer to the cascade only lowers `lam`, so budgets still only shrink.
`excess="drop"` keeps the proportional share and cuts it at the cap (the authors' LAVa
code, `adaptive_mistral_hijack_lava.py` lines 155-166 with `snapkv_utils.py` line 751:
a layer whose per-head budget exceeds its prefix is left uncompressed).

Rounding (a choice; the papers use real numbers): `rounding="remainder"`: the final
allocation is largest remainder (floors, then +1 to the largest fractional parts, ties to
the lower layer; capped layers get no +1), so it sums to `total` whenever the caps allow.
While cascading, intermediate budgets are ceilings and take a `min` with the previous
budget: each is >= the final largest-remainder budget, so budgets only shrink and the
kept sets of the cascading and non-cascading forms are equal. `rounding="head_floor"`:
the per-head budget `int(share / K)` times K, at every cascade step (the authors' code,
`adaptive_mistral_hijack_lava.py` line 160 and `snapkv_utils.py` line 762).

Static slots (`head_cap`): the cache is a fixed-shape [L, B, K, S] layout (docs/design.md,
"The cache"), so S, the slots of one (layer, head), bounds every head's count. LAVa's
flattened head budgets could hand one head a whole layer's budget; `head_cap` bounds a
head at `ceil(head_cap * (budget - window))` prefix entries (the average per-head prefix
budget times `head_cap`; None: the whole prompt). A capped head's excess goes to the next
entries of the other heads of its layer (the flattened top-k over the entries within the
cap), a layer's budget is capped at `K * min(cap, P)` and water-filled as above. Whenever
no cap binds the kept sets are the paper's; the stat `head_cap_binds` says when one did.

Bounded memory (cascade): each layer's kept entries are compacted into its S slots of a
buffer carried through the prefill scan as soon as the layer is processed; later cascade
steps only clear `valid` bits (budgets only shrink), and `finalize` re-compacts within the
S slots. The scan's stacked output still names every layer's full K/V, for a wrapped
selection rule (CriticalKV, `select_final` with `choose`) that picks among all entries
once the counts are final; when nothing reads it (LAVa or CAKE alone), jit's dead-code
elimination drops it, so the program holds the [L, B, K, S] buffer, one layer's full K/V
and the per-layer scores and ranks ([L, B, K, P], 13 bytes an entry), not L layers of
full K/V (measured: `kvjax.bench.cascade_memory`, `tests/test_lava_memory.py`).

Everything here is jnp on traced arrays (used inside the prefill scan).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.compression import budgets, selection
from kvjax.compression.eviction import Chooser, HeadBudgets, PrefillEviction, real_length
from kvjax.compression.heads import Heads
from kvjax.compression.heads import flat_rank as split_flat_rank
from kvjax.compression.layer import LayerIO, LayerKV
from kvjax.config import ModelConfig

HEADS = ("flat", "uniform", "safeguard")
LAYERS = ("entropy", "uniform")
EXCESS = ("refill", "drop")
ROUNDINGS = ("remainder", "head_floor")
FLOORS = ("constant", "layer")
_BIG = jnp.iinfo(jnp.int32).max


def allocate(weights_LB: Float[Array, "L B"], active_L: Bool[Array, "L"], total_B: Int[Array, "B"],
             cap_B: Int[Array, "B"], final, excess: str = "refill", rounding: str = "remainder",
             K: int = 1) -> Int[Array, "L B"]:
    """Budgets [L, B] of the active layers (0 elsewhere), entries over a layer's K heads.

    Shares: `total * w_l / sum_active w` (all weights zero: uniform over the active
    layers); `excess="refill"` water-fills what exceeds a layer's cap onto the others
    (`budgets.water_fill`), `"drop"` cuts it. Rounding: `"remainder"`: largest remainder where
    `final` (a traced bool is fine), ceilings otherwise; `"head_floor"`: `K * floor(x / K)`
    at every step (the authors' LAVa code)."""
    b = allocate_uncapped(weights_LB, active_L, total_B, cap_B, final, excess, rounding, K)
    return jnp.minimum(b, cap_B[None, :])


def allocate_uncapped(weights_LB, active_L, total_B, cap_B, final, excess: str = "refill",
                      rounding: str = "remainder", K: int = 1) -> Int[Array, "L B"]:
    """`allocate` before the final `min` with the cap (above it only with
    `excess="drop"`: the share a layer cannot hold)."""
    if excess not in EXCESS:
        raise ValueError(f"excess={excess!r}; allowed: {EXCESS}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}; allowed: {ROUNDINGS}")
    act = active_L[:, None]
    w = jnp.where(act, jnp.maximum(weights_LB, 0.0), 0.0)
    # all weights zero: share uniformly among the active layers
    w = jnp.where(jnp.sum(w, axis=0, keepdims=True) > 0, w, act.astype(jnp.float32))
    cap = cap_B[None, :]
    if excess == "refill":
        # min(cap, lam w) summing to the total: a layer of weight 0 (or inactive) holds 0
        hi = jnp.where(act & (w > 0), cap, 0)
        x = jax.vmap(budgets.water_fill, in_axes=(1, None, 1, 0), out_axes=1)(
            w, 0.0, hi, total_B)
        target = jnp.minimum(total_B, jnp.sum(jnp.where(act, cap, 0), axis=0))
    else:
        x = w / jnp.sum(w, axis=0, keepdims=True) * total_B[None, :].astype(jnp.float32)
        hi = jnp.broadcast_to(jnp.where(act, jnp.inf, 0.0), x.shape)  # no cap but inactive
        target = total_B
    if rounding == "head_floor":
        b = K * jnp.floor(x / K).astype(jnp.int32)
    else:
        lr = jax.vmap(budgets.largest_remainder, in_axes=(1, 1, 0), out_axes=1)(x, hi, target)
        b = jnp.where(final, lr, jnp.ceil(x).astype(jnp.int32))
    if excess == "refill":
        b = jnp.minimum(b, cap)  # float safety: a water-filled budget is at most its cap
    return jnp.where(act, b, 0)


def flat_rank(s_BKP: Float[Array, "B K P"], eligible_BKP: Bool[Array, "B K P"] | None = None,
              heads: Heads = Heads(), cap: int | None = None) -> Int[Array, "B K P"]:
    """Rank of every entry in one order over heads x positions (best 0; ties: lower flat
    index first, as `lax.top_k`); entries not `eligible` (beyond a head's cap) after all
    the eligible ones, so a top-b over this rank is the flattened top-b within the caps.
    `heads` split: the ranks of this block's heads in the order over every block (`cap`:
    the eligible entries per head, which bounds what each device gathers)."""
    if heads.split:
        return split_flat_rank(s_BKP, eligible_BKP, heads, cap)
    B, K, P = s_BKP.shape
    key = -s_BKP if eligible_BKP is None else jnp.where(eligible_BKP, -s_BKP, jnp.inf)
    order = jnp.argsort(key.reshape(B, K * P), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    return rank.reshape(B, K, P).astype(jnp.int32)


def head_rank(s_BKP: Float[Array, "B K P"]) -> Int[Array, "B K P"]:
    """Rank of every entry within its head (best 0; ties: lower position first)."""
    order = jnp.argsort(-s_BKP, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def cap_rank(s_BKP: Float[Array, "B K P"], hrank_BKP: Int[Array, "B K P"], cap: int,
             heads: Heads = Heads()) -> Int[Array, "B K"]:
    """The uncapped flat rank of each head's entry at head rank `cap` (the first one the
    cap excludes); int32 max where the head has no such real entry. A flattened top-b
    without caps would give head k more than `cap` entries iff this rank is < b. `heads`
    split: every block counts its entries before every head's entry, summed."""
    B, K, P = s_BKP.shape
    if cap >= P:
        return jnp.full((B, K), _BIG, jnp.int32)
    at = hrank_BKP == cap  # one entry per head
    s_e = jnp.max(jnp.where(at, s_BKP, -jnp.inf), axis=-1)  # [B, K]
    first = heads.offset(K) * P  # flat index of this block's first entry
    i_e = jnp.argmax(at, axis=-1) + jnp.arange(K) * P + first  # flat index [B, K]
    s_all, i_all = heads.gather(s_e, 1), heads.gather(i_e, 1)  # every head's [B, Kg]
    flat = s_BKP.reshape(B, 1, K * P)
    idx = jnp.arange(K * P) + first
    before = (flat > s_all[..., None]) | ((flat == s_all[..., None]) & (idx < i_all[..., None]))
    r = heads.mine(heads.sum(jnp.sum(before, axis=-1, dtype=jnp.int32)), K)
    return jnp.where(s_e > -jnp.inf, r, _BIG)


def prefix_keep(frank_BKP, hrank_BKP, budget_B, mode: str, alpha: float = 0.0,
                cap: int | None = None, floor_const: int | None = None, over_B=None,
                heads: Heads = Heads()):
    """Keep mask [B, K, P] of the prefix for a layer budget `budget_B` (entries over heads),
    and which heads' counts were cut at `cap` [B, K] (safeguard's mixed count only).

    mode "flat": one top-budget over heads x positions (LAVa Sec. 4.1, AdaKV), by the
    capped flat rank; "uniform": every head keeps budget // K (the first budget % K heads
    one more); "safeguard": the authors' LAVa code (`snapkv_utils.py` lines 762-769): the
    flattened counts mixed with a floor, `round(count * (1 - alpha) + floor)` per head by
    its own ranking, `floor = floor_const` (the code's `int(base_capacity * alpha)`) or,
    when None, `floor(budget / K * alpha)` (this layer's budget); at most `cap`; a layer
    whose share was over what it holds (`over_B`) keeps everything (line 751: the code
    does not compress it). `heads` split: the masks of this block's heads (`frank` ranks
    every block's entries; head numbers and K are global).
    """
    K = heads.total(frank_BKP.shape[1])
    b = budget_B[:, None, None]
    none = jnp.zeros(frank_BKP.shape[:2], bool)
    if mode == "flat":
        return frank_BKP < b, none
    if mode == "uniform":
        h = (jnp.arange(frank_BKP.shape[1]) + heads.offset(frank_BKP.shape[1]))[None, :, None]
        per = b // K + (h < b % K)
        return hrank_BKP < per, none
    if mode == "safeguard":
        count = jnp.sum(frank_BKP < b, axis=-1, keepdims=True).astype(jnp.float32)
        if floor_const is None:
            floor = jnp.floor(b.astype(jnp.float32) / K * alpha)
        else:
            floor = jnp.float32(floor_const)
        per = jnp.round(count * (1 - alpha) + floor).astype(jnp.int32)
        if over_B is not None:
            per = jnp.where(over_B[:, None, None], _BIG, per)
        held = none
        if cap is not None:
            held = ((per > cap) & (per < _BIG))[..., 0]
            per = jnp.minimum(per, cap)
        return hrank_BKP < per, held
    raise ValueError(f"head mode={mode!r}; allowed: {HEADS}")


@dataclasses.dataclass(frozen=True)
class Cascading(PrefillEviction):
    """Shared core: per-layer prefix scores and a layer weight, budgets by cascade.

    `heads` (flat / uniform / safeguard, `prefix_keep`), `layers` (entropy: the subclass's
    `layer_weight`; uniform), `cascade` (Algorithm 2 into the bounded buffer; False: every
    layer at full length, budgets in `finalize`), `head_cap` (the static per-head slots as a
    multiple of `budget - window`; None: the whole prompt), `excess` (refill: water-fill a
    layer's excess over its cap; drop), `rounding` (remainder; head_floor), `alpha` and
    `safeguard_floor` (the safeguard's mix and floor: constant, the code's; layer)."""

    name: ClassVar[str] = "_cascading"
    budget: int = 128
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    heads: str = "flat"
    layers: str = "entropy"
    cascade: bool = True
    alpha: float = 0.0
    head_cap: float | None = 8.0
    excess: str = "refill"
    rounding: str = "remainder"
    safeguard_floor: str = "constant"

    def splits_heads(self) -> bool:
        # per-head scores and ranks; the flat ranks, the layer weights' sums over heads and
        # the live counts through `io.heads` (a subclass's `layer_weight` must use it too)
        return True

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if self.budget <= self.window:
            raise ValueError(
                f"budget={self.budget} cannot hold the window ({self.window} entries) of every "
                f"layer and head; allowed: window {self.window} < budget <= prompt length {n}")
        super().validate(n, cfg)
        for field, allowed in (("heads", HEADS), ("layers", LAYERS), ("excess", EXCESS),
                               ("rounding", ROUNDINGS), ("safeguard_floor", FLOORS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r}; allowed: {allowed}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha} outside [0, 1]")
        if self.head_cap is not None and not self.head_cap >= 1:
            raise ValueError(
                f"head_cap={self.head_cap}: a head's slots as a multiple of the average "
                "per-head prefix budget (budget - window) must hold that average; allowed: "
                "head_cap >= 1, or null (room for the whole prompt)")

    # ---- shapes -----------------------------------------------------------------------

    def cap_entries(self, n: int) -> int:
        """Static prefix slots of one (layer, head) for an n-token (padded) prompt."""
        P = n - self.window
        if self.head_cap is None:
            return P
        return int(min(P, math.ceil(self.head_cap * (self.budget - self.window))))

    def kept_slots(self, n: int) -> int:
        return self.window + self.cap_entries(n)

    def slots(self, n: int, L: int = 0, K: int = 0) -> int:
        return self.kept_slots(n)

    def cache_slots(self, n: int, cfg: ModelConfig) -> int:
        return self.kept_slots(n)

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
        st = dict(
            scores=jnp.zeros((L, batch, K, P), jnp.float32),
            frank=jnp.zeros((L, batch, K, P), jnp.int32),
            hrank=jnp.zeros((L, batch, K, P), jnp.int32),
            caprank=jnp.full((L, batch, K), _BIG, jnp.int32),
            weight=jnp.zeros((L, batch), jnp.float32),
            budget=jnp.full((L, batch), _BIG, jnp.int32),
            over=jnp.zeros((L, batch), bool),
            keep=jnp.ones((L, batch, K, P), bool),
            held=jnp.zeros((L, batch, K), bool),  # safeguard counts cut at the cap
            shrank=jnp.ones((), bool),
            peak=jnp.zeros((batch,), jnp.int32),
            n_real=jnp.zeros((batch,), jnp.int32),
        )
        if self.cascade:
            S, D = self.kept_slots(n), cfg.head_dim
            # float32: init_state sees no model dtype; finalize casts to the model's
            st["buf"] = LayerKV(jnp.zeros((L, batch, K, S, D), jnp.float32),
                                jnp.zeros((L, batch, K, S, D), jnp.float32),
                                jnp.zeros((L, batch, K, S), jnp.int32),
                                jnp.zeros((L, batch, K, S), bool))
            st["col"] = jnp.zeros((L, batch, K, S), jnp.int32)
        return st

    def _budgets(self, st, active, total, cap, final, K):
        """(budgets [L, B], whether a layer's share was over its cap [L, B])."""
        if self.layers == "uniform":
            w = jnp.ones_like(st["weight"])
        else:
            w = st["weight"]
        b = allocate_uncapped(w, active, total, cap, final, self.excess, self.rounding, K)
        return jnp.minimum(b, cap[None, :]), b > cap[None, :]

    def _floor_const(self):
        if self.safeguard_floor == "constant":
            # LavaKVCluster.__init__ (snapkv_utils.py line 543): int(base_capacity * alpha),
            # base_capacity the configured per-head budget, window included
            return int(self.budget * self.alpha)
        return None

    def _masks(self, st, budget_LB, cap: int, split: Heads = Heads()):
        """(keep masks [L, B, K, P], a safeguard count held at the cap [L, B]); `split`:
        the KV heads the state holds (`LayerIO.heads`)."""
        def one(fr, hr, b, over):
            return prefix_keep(fr, hr, b, self.heads, self.alpha, cap, self._floor_const(),
                               over, split)
        return jax.vmap(one)(st["frank"], st["hrank"], budget_LB, st["over"])

    def _totals(self, n_real_B, L: int, K: int, cap: int):
        P_real = n_real_B - self.window  # [B]
        total = jnp.full_like(P_real, (self.budget - self.window) * L * K)
        return total, K * jnp.minimum(P_real, cap)

    def _rank(self, st, l, s, cap: int, split: Heads = Heads()):
        """Stores layer l's scores and ranks (flat rank within the head cap)."""
        hr = head_rank(s)
        st["scores"] = st["scores"].at[l].set(s)
        st["hrank"] = st["hrank"].at[l].set(hr)
        st["frank"] = st["frank"].at[l].set(flat_rank(s, hr < cap, split, cap))
        st["caprank"] = st["caprank"].at[l].set(cap_rank(s, hr, cap, split))
        return st

    def after_layer_prefill(self, io: LayerIO, st):
        """Stores the layer's scores, ranks and weight; cascading: recomputes the budgets
        of layers 0..l, shrinks their keep masks, compacts layer l into its slots of the
        buffer and clears the bits of the earlier layers' entries the masks dropped."""
        L = st["weight"].shape[0]
        l = io.layer
        T = io.k.shape[2]
        cap = self.cap_entries(T)
        s = self.prefix_scores(io)
        st = self._rank(dict(st), l, s, cap, io.heads)
        st["weight"] = st["weight"].at[l].set(self.layer_weight(io, s))
        n_real = real_length(io)
        st["n_real"] = n_real
        if self.cascade:
            K = io.heads.total(io.k.shape[1])
            layers = jnp.arange(L)
            before = layers < l
            live_before = jnp.sum(jnp.where(before[:, None], self._live(st, io, io.heads), 0),
                                  axis=0)
            st["peak"] = jnp.maximum(st["peak"], live_before + K * n_real)
            total, lcap = self._totals(n_real, L, K, cap)
            now = (layers <= l)[:, None]
            raw, over = self._budgets(st, layers <= l, total, lcap, l == L - 1, K)
            # the claim "budgets only shrink", checked on the raw recomputed budgets
            grew = before[:, None] & (raw > st["budget"])
            st["shrank"] = st["shrank"] & ~jnp.any(grew)
            b = jnp.where(now, jnp.minimum(raw, st["budget"]), st["budget"])
            st["budget"] = b
            st["over"] = jnp.where(now, over, st["over"])
            keep, st["held"] = self._masks(st, b, cap, io.heads)
            st["keep"] = st["keep"] & keep
            st = self._buffer(io, st, T)
        return io.kv, None, st

    def _buffer(self, io: LayerIO, st, T: int):
        """Layer l's kept entries (window included) into its S slots, ascending; the
        earlier layers' entries the shrunken masks dropped lose their `valid` bit."""
        S = st["buf"].k.shape[3]
        keep_ext = self._with_window(st["keep"], T)  # [L, B, K, T]
        keep_l = io.at_layer(keep_ext) & io.valid
        idx, live = selection.slots_from_mask(keep_l, S)
        new = selection.gather_kept(io.kv, idx, live, io.kernels.compact)
        buf = st["buf"]
        buf = LayerKV(io.set_layer(buf.k, new.k.astype(buf.k.dtype)),
                      io.set_layer(buf.v, new.v.astype(buf.v.dtype)),
                      io.set_layer(buf.pos, new.pos), io.set_layer(buf.valid, new.valid))
        col = io.set_layer(st["col"], idx.astype(jnp.int32))
        valid = buf.valid & jnp.take_along_axis(keep_ext, col, axis=-1)
        st["buf"] = LayerKV(buf.k, buf.v, buf.pos, valid)
        st["col"] = col
        return st

    def _with_window(self, keep_LBKP, T: int):
        L, B, K, P = keep_LBKP.shape
        return jnp.concatenate([keep_LBKP, jnp.ones((L, B, K, T - P), bool)], axis=-1)

    def _live(self, st, io_or_valid, split: Heads = Heads()):
        """[L, B] live entries per layer (window included) under the current masks."""
        K, w = split.total(st["keep"].shape[2]), self.window
        valid = io_or_valid.valid[:, 0] if isinstance(io_or_valid, LayerIO) else io_or_valid
        P = st["keep"].shape[-1]
        pv = valid[:, :P]
        prefix = split.sum(jnp.sum(st["keep"] & pv[None, :, None, :], axis=(2, 3)))
        return (prefix + K * w).astype(jnp.int32)

    def finalize(self, kv: LayerKV, aux, st):
        return self.select_final(kv, st, None)

    def select_final(self, kv: LayerKV, st, choose: Chooser | None):
        """The final budgets, keep masks and compaction; `choose` (a wrapper's selection
        rule, e.g. CriticalKV) picks which entries each head keeps at the counts of its
        final mask from every layer's full rows `kv`, None keeps the mask itself (from the
        bounded buffer when cascading: then `kv`'s data is not read)."""
        L, B, K, T = kv.k.shape[:4]
        st = dict(st)
        cap = self.cap_entries(T)
        if not self.cascade:
            total, lcap = self._totals(st["n_real"], L, K, cap)
            b, st["over"] = self._budgets(st, jnp.ones((L,), bool), total, lcap, True, K)
            st["budget"] = b
            st["keep"], st["held"] = self._masks(st, b, cap)
            st["peak"] = L * K * st["n_real"]
        S = self.slots(T)
        r = lambda x: x.reshape((L * B,) + x.shape[2:])  # noqa: E731
        if choose is None and self.cascade:
            buf = st["buf"]
            idx, live = selection.slots_from_mask(r(buf.valid), S)
            out = selection.gather_kept(jax.tree.map(r, buf), idx, live)
            out = LayerKV(out.k.astype(kv.k.dtype), out.v.astype(kv.v.dtype), out.pos, out.valid)
        else:
            keep = self.final_keep(st, kv.valid)
            if choose is None:
                idx, live = selection.slots_from_mask(r(keep), S)
            else:
                window = jnp.full((L, B, K, self.window), jnp.inf)
                s = jnp.where(kv.valid, jnp.concatenate([st["scores"], window], axis=-1),
                              -jnp.inf)
                count = jnp.sum(keep, axis=-1, dtype=jnp.int32)
                idx, live = choose(None, r(s), HeadBudgets(r(count)), S)
            out = selection.gather_kept(jax.tree.map(r, kv), idx, live)
        out = jax.tree.map(lambda x: x.reshape((L, B) + x.shape[1:]), out)
        per_entry = 2 * kv.k.shape[-1] * kv.k.dtype.itemsize
        live_LBK = jnp.sum(out.valid, axis=-1, dtype=jnp.int32)
        stats = {
            "layer_budgets": jnp.moveaxis(live_LBK, 1, 0),  # [B, L, K]
            "layer_weight": st["weight"].T,  # [B, L] entropy (LAVa) / preference (CAKE)
            "peak_live_kv_bytes": st["peak"] * per_entry,
            "live_kv_bytes": jnp.sum(live_LBK, axis=(0, 2)) * per_entry,
            "allocated_kv_bytes": jnp.full((B,), L * K * S * per_entry),
            "full_kv_bytes": st["n_real"] * L * K * per_entry,
            "budgets_shrank": jnp.broadcast_to(st["shrank"], (B,)),
            "head_cap_binds": self._cap_binds(st, cap, K),
        }
        return out, None, stats

    def _cap_binds(self, st, cap: int, K: int):
        """[B] whether the static head cap changed the result: a layer's budget held at
        `K * cap` below its `K * P`, a head whose uncapped flattened count would pass the
        cap (flat, safeguard), or a safeguard count cut at the cap."""
        b = st["budget"]  # [L, B]
        P_real = st["n_real"] - self.window
        layer = (b >= K * cap) & (cap < P_real)[None, :]
        head = jnp.zeros_like(layer)
        if self.heads in ("flat", "safeguard"):
            head = jnp.any(st["caprank"] < b[..., None], axis=-1)
        # a safeguard count cut at the cap, in a head that has entries beyond it
        held = jnp.any(st["held"] & (st["caprank"] < _BIG), axis=-1)
        return jnp.any(layer | head | held, axis=0)

    def final_keep(self, st, valid_LBKT):
        """[L, B, K, T] the final keep masks: the budgets' prefix masks plus the window."""
        return self._with_window(st["keep"], valid_LBKT.shape[-1]) & valid_LBKT
