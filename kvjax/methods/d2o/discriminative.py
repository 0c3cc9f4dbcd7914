"""D2O (Wan et al. 2025, "D2O: dynamic discriminative operations for efficient long-context
inference of large language models"; D2O paper; docs/methods.md, "D2O").

Layer level (Eq. 4-5): F_v^l = variance over prompt columns of the layer's attention column
sums (H2O's accumulated attention, computed blockwise by `kvjax.compress.scoring.cumulative_attention`,
never [H, n, n]); per query head, then the mean over all query heads (so GQA does not
enter the budget). alpha_l = L * softmax_l(-F_v), S_l = floor(alpha_l * budget) clipped to
[T + 2, slots] -- `budget` is the average per layer (the paper's S * rho; kvpress's
`--ratio r` gives budget = n (1 - r), i.e. rho = 1 - r). `variance_layers=False`: S_l = budget. The budgets are data computed in
`finalize` (cross-layer), the cache has `slots = min(n, ceil(cap * budget))` slots
(+1 decode slot); in the code variant alpha is clamped to [0.01, 1] (S_l <= n, capacity n)
and layers 0, 1, L-1 keep everything.

Token level (Eq. 6-9): accumulated attention (GQA: mean over the query heads of a KV head,
as H2O here); every head keeps the first `sinks` positions (T), the M_l = max(1,
floor((S_l - T) * recent_ratio)) most recent, and the top N_l = S_l - T - M_l of the rest.
Paper N:M = 3:1 (recent_ratio 0.25), code 1:1 (0.5).

Merging (Eq. 8-12): cosine similarity of each evicted key with the kept keys of its head
(RoPE'd keys, as cached); nearest kept j; EMA threshold tau (per layer, element, KV head):
prompt tau_0 = mean over the evicted of their max similarity; at a decode step with an
eviction tau_t = beta * max(U_t) + (1 - beta) * tau_{t-1} (unchanged at steps without one).
An evicted entry with max similarity >= tau (tau_t after the update, equivalent to >=
tau_{t-1} for beta < 1) merges into j:
  softmax (paper):  k_j <- (e k_j + sum_i exp(u_ij) k_i) / (e + sum_i exp(u_ij))
  mean    (code):   k_j <- (k_j + sum_i u_ij k_i) / (1 + #merged into j)
values with the same weights; otherwise it is discarded. Positions and validity of j do
not change; its accumulated score is kept (the paper says nothing about it).

Prefill: D2O's hook keeps the layer's full prompt (k, v, accumulated scores) until
`finalize`, because the per-layer budget needs every layer's F_v (the same memory as the
`full` prefill; the merge there builds [B, K, n, n] similarities -- fine at 2-8k, not at
128k). `prefill_merge=False` evicts at prefill without merging (the authors' code does no
prefill merge; it also does no prefill *eviction*, which a fixed-capacity cache cannot
express: here the prompt is cut to S_l at prefill in both variants).

Decode (inside the jitted loop, `DecodeEviction` hooks): the new token's attention is added
to the scores, the lowest-scoring evictable entry (not a sink, not among the M_l newest) of
each head goes when live > S_l, and is merged into its nearest kept slot (only that row
of the cache is rewritten) or discarded. Method state: acc [L,B,K,C], tau [L,B,K], budgets
S_l [L,B], recent M_l [L,B], merges / discards [L,B] counters (decode only; the prefill's
are in the stats).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.compress import scoring, selection
from kvjax.compress.eviction import DecodeEviction, query_sum
from kvjax.compress.layer import LayerIO, LayerKV
from kvjax.config import ModelConfig
from kvjax.methods.d2o.merging import MERGES, merge, nearest
from kvjax.methods.registry import register

VARIANCES = ("raw", "minmax")


@register
@dataclasses.dataclass(frozen=True)
class D2O(DecodeEviction):
    """D2O, paper defaults: variance-softmax layer budgets, T=4 sinks, N:M = 3:1, EMA
    threshold (beta 0.7) merging with softmax weights, at prefill and every decode step."""

    name: ClassVar[str] = "d2o"
    forced_what: ClassVar[str] = "the sinks and recent window"
    budget: int = 128
    sinks: int = 4
    recent_ratio: float = 0.25  # M / (N + M): N:M = 3:1
    beta: float = 0.7
    merge: bool = True
    merge_kind: str = "softmax"
    prefill_merge: bool = True
    variance_layers: bool = True  # Eq. 4-5 layer sizes S_l; False: S_l = budget
    variance: str = "raw"
    cap: float = 2.0  # slots = min(n, ceil(cap * budget)) (the largest layer budget)
    alpha_clamp: bool = False  # code: alpha_l * rho clamped to [0.01, 1]
    full_edge_layers: bool = False  # code: layers 0, 1, L-1 keep everything
    gqa: str = "mean"
    block: int = 256

    @property
    def forced(self) -> int:
        return self.sinks + 1

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if self.merge_kind not in MERGES:
            raise ValueError(f"merge_kind={self.merge_kind!r}; allowed: {MERGES}")
        if self.variance not in VARIANCES:
            raise ValueError(f"variance={self.variance!r}; allowed: {VARIANCES}")
        if not 0 < self.recent_ratio < 1:
            raise ValueError(f"recent_ratio={self.recent_ratio} outside (0, 1)")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"beta={self.beta} outside [0, 1]")
        super().validate(n, cfg)

    def kept_slots(self, n: int) -> int:
        if self.full_edge_layers or self.alpha_clamp:
            return n
        return min(n, math.ceil(self.cap * self.budget))

    # ---- prefill ------------------------------------------------------------------------

    def after_layer_prefill(self, io: LayerIO, state):
        valid = io.valid[:, 0]
        acc = scoring.cumulative_attention(io.q, io.k, io.qpos, valid, io.pos, io.valid,
                                           self.block)  # [B, K, G, T]
        B, K, G, T = acc.shape
        cols = valid[:, None, None, :]
        x = acc
        if self.variance == "minmax":
            lo = jnp.min(jnp.where(cols, x, jnp.inf), axis=-1, keepdims=True)
            hi = jnp.max(jnp.where(cols, x, -jnp.inf), axis=-1, keepdims=True)
            x = (x - lo) / jnp.maximum(hi - lo, 1e-12)
        cnt = jnp.maximum(jnp.sum(valid, axis=-1), 1)[:, None, None]
        mean = jnp.sum(jnp.where(cols, x, 0.0), axis=-1) / cnt
        var = jnp.sum(jnp.where(cols, (x - mean[..., None]) ** 2, 0.0), axis=-1) / cnt
        fv = jnp.mean(var.reshape(B, -1), axis=-1)  # [B]
        red = jnp.where(io.valid, scoring.gqa_reduce(acc, self.gqa), 0.0)
        return io.kv, (red, fv), state  # finalize needs every layer's F_v

    def budgets(self, fv_LB, n_B):
        """S_l [L, B] from F_v [L, B] and the real prompt lengths [B]."""
        L = fv_LB.shape[0]
        n = n_B[None].astype(jnp.float32)
        if not self.variance_layers:
            s = jnp.full(fv_LB.shape, float(self.budget))
        else:
            a = L * jax.nn.softmax(-fv_LB, axis=0)
            if self.alpha_clamp:
                s = jnp.clip(a * self.budget / n, 0.01, 1.0) * n
            else:
                s = a * self.budget
        s = jnp.floor(s).astype(jnp.int32)
        s = jnp.clip(s, self.forced + 1, n_B[None])
        if self.full_edge_layers:
            for l in (0, 1, L - 1):
                s = s.at[l].set(n_B)
        return s

    def recent_count(self, s_LB):
        return jnp.maximum(1, jnp.floor((s_LB - self.sinks) * self.recent_ratio)
                           .astype(jnp.int32))

    def finalize(self, kv: LayerKV, aux, state):
        k, v, pos, valid = kv.k, kv.v, kv.pos, kv.valid  # [L, B, K, T, ...]
        acc, fv = aux  # [L, B, K, T], [L, B]
        L, B, K, T = pos.shape
        S = self.kept_slots(T)
        n_B = jnp.sum(valid[0, :, 0], axis=-1, dtype=jnp.int32)
        s_LB = jnp.minimum(self.budgets(fv, n_B), S)
        m_LB = self.recent_count(s_LB)

        def layer(k, v, pos, valid, acc, s_B, m_B):
            top = jnp.max(jnp.where(valid, pos, -1), axis=-1, keepdims=True)
            forced = valid & ((pos < self.sinks) | (pos > top - m_B[:, None, None]))
            sc = jnp.where(forced, jnp.inf, jnp.where(valid, acc, -jnp.inf))
            idx, live = selection.slots_from_scores(sc, jnp.broadcast_to(s_B[:, None], (B, K)), S)
            keep = selection.mark(valid.shape, idx, live, reduce="max") & valid
            gone = valid & ~keep
            # gather first, then merge every prompt entry against the S kept slots:
            # [B, K, T, S] similarities, not [B, K, T, T]
            g = selection.compact(LayerKV(k, v, pos, valid), idx, live)
            gk, gv, gvalid = g.k, g.v, g.valid
            near = nearest(gk, gvalid, k)
            ng = jnp.sum(gone, axis=-1)
            tau = jnp.where(ng > 0, jnp.sum(jnp.where(gone, near[1], 0.0), -1)
                            / jnp.maximum(ng, 1), 1.0)
            gk, gv, merged, _ = merge(gk, gv, gvalid, k, v, gone, tau, self.merge_kind,
                                      self.merge and self.prefill_merge, near)
            g = LayerKV(gk, gv, g.pos, gvalid)
            a = jnp.where(gvalid, jnp.take_along_axis(acc, idx, axis=-1), 0.0)
            nm = jnp.sum(merged, axis=(-1, -2))
            return g, a, tau, nm, jnp.sum(gone, axis=(-1, -2)) - nm

        g, a, tau, nm, nd = jax.vmap(layer)(k, v, pos, valid, acc, s_LB, m_LB)
        z = jnp.zeros((L, B), jnp.int32)
        state = {"acc": a, "tau": tau, "budget": s_LB, "recent": m_LB, "merges": z,
                 "discards": z}
        live = jnp.sum(g.valid, axis=-1, dtype=jnp.int32)
        stats = {"layer_budgets": jnp.moveaxis(live, 1, 0),  # [B, L, K] live after prefill
                 "layer_sizes": jnp.moveaxis(s_LB, 1, 0),  # [B, L]: S_l
                 "prefill_merges": jnp.moveaxis(nm, 1, 0), "prefill_discards":
                 jnp.moveaxis(nd, 1, 0), "tau0": jnp.moveaxis(tau, 1, 0)}
        return g, state, stats

    def pad_state(self, st, capacity: int):
        acc = st["acc"]
        return {**st, "acc": jnp.pad(acc, [(0, 0)] * 3 + [(0, capacity - acc.shape[-1])])}

    # ---- decode -------------------------------------------------------------------------

    def decode_layer(self, io: LayerIO, probs, st):
        take, put = io.at_layer, io.set_layer
        add = scoring.gqa_reduce(query_sum(probs, io.qvalid), self.gqa)  # [B, K, C]
        acc = take(st["acc"]) + add
        s_B, m_B = take(st["budget"]), take(st["recent"])
        top = jnp.max(jnp.where(io.valid, io.pos, -1), axis=-1, keepdims=True)
        evictable = io.valid & (io.pos >= self.sinks) & (io.pos <= top - m_B[:, None, None])
        live = jnp.sum(io.valid, axis=-1, dtype=jnp.int32)
        excess = jnp.maximum(live - s_B[:, None], 0)
        T = min(io.q.shape[1], io.k.shape[-2])
        gone = selection.evict_lowest(acc, evictable, excess, T)
        kept = io.valid & ~gone
        tau_prev = take(st["tau"])
        # at most T entries of a head go per step: their slots, then U_t (their
        # similarities with the kept ones) -- [B, K, T, C], never [B, K, C, C]
        src = (jnp.argmax(gone, axis=-1)[..., None] if T == 1  # XLA:CPU's top_k sorts: 1 ms
               else jax.lax.top_k(gone.astype(jnp.int32), T)[1])  # [B, K, T]
        ks, vs = (jnp.take_along_axis(x, src[..., None], axis=-2) for x in (io.k, io.v))
        near = nearest(io.k, kept, ks)
        gone_src = jnp.take_along_axis(gone, src, axis=-1)
        umax = jnp.max(jnp.where(gone_src, near[1], -jnp.inf), axis=-1)  # [B, K]
        any_gone = jnp.any(gone, axis=-1)
        tau = jnp.where(any_gone, self.beta * umax + (1 - self.beta) * tau_prev, tau_prev)
        k, v, merged, _ = merge(io.k, io.v, kept, ks, vs, gone_src, tau, self.merge_kind,
                                self.merge, near, rows=True)
        nm = jnp.sum(merged, axis=(-1, -2), dtype=jnp.int32)
        nd = jnp.sum(gone, axis=(-1, -2), dtype=jnp.int32) - nm
        st = {**st, "acc": put(st["acc"], jnp.where(gone, 0.0, acc)),
              "tau": put(st["tau"], tau),
              "merges": put(st["merges"], take(st["merges"]) + nm),
              "discards": put(st["discards"], take(st["discards"]) + nd)}
        return LayerKV(k, v, io.pos, kept), st


@register
@dataclasses.dataclass(frozen=True)
class D2OCode(D2O):
    """D2O as in the authors' code (AIoT-MLSys-Lab/d2o): 1:1 heavy:recent, beta 0.5, mean
    merge, min-max normalised variance, alpha clamped to [0.01, 1], layers 0, 1, L-1
    uncompressed, no prefill merge (see the module docstring for the prefill eviction)."""

    name: ClassVar[str] = "d2o_code"
    recent_ratio: float = 0.5
    beta: float = 0.5
    merge_kind: str = "mean"
    prefill_merge: bool = False
    variance: str = "minmax"
    alpha_clamp: bool = True
    full_edge_layers: bool = True
