"""D2O (Wan et al. 2025, "D2O: dynamic discriminative operations for efficient long-context
inference of large language models"; docs/methods.md, "D2O"), and the authors' code
(AIoT-MLSys-Lab/d2o, `LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py`,
"the code" below, with the layer ratios of `modeling_llama3_new.py:692-723`).

Two schedules (`evict_at`), one per variant:

`d2o` (the paper, `evict_at="prefill"`). Layer level (D2O paper, Eq. 4-5): F_v^l = variance
over the prompt columns of the layer's attention column sums (H2O's accumulated attention,
`kvjax.compression.scoring.cumulative_attention`, blockwise, never [H, n, n]), per query head,
then the mean over the query heads (`variance="raw"`: population variance). S_l = alpha_l *
budget with alpha_l = L * softmax_l(-F_v) (`budget` is the paper's rho * S, the average per
layer). Each S_l lies in [T + 2, min(n, slots)], slots = min(n, ceil(cap * budget)) (the
static cache size, `cap`). Open reading `cap_excess`: "redistribute" (default) water-fills
-- S_l = clip(c * alpha_l * budget, lo, hi) with c chosen so that the S_l sum to budget * L
(Eq. 13) -- then rounds to integers that keep the sum (floors, plus one for the largest
fractional parts; `waterfill`); "drop" floors Eq. 5 and clips, so whatever the cap and the
floors remove is lost. The stats report `budget_gap` = budget * L - sum S_l (0 under
"redistribute" whenever the bounds allow the total). Layers kept whole (`full_first`,
`full_last`; none in the paper) keep n and stay outside that sum. Token level (Eq. 6-8):
every head keeps the first `sinks` positions (T), the M_l most recent and the top
N_l = S_l - T - M_l of the rest by accumulated attention (GQA: mean over the query heads of
a KV head). Open reading `recent_round`: M_l = max(1, floor((S_l - T) * recent_ratio)) ("floor",
default) or ceil ("ceil"); N:M = 3:1 is recent_ratio 0.25. Merging (Eq. 9-12): each evicted
key's nearest kept key of its head by cosine (RoPE'd keys, as cached); threshold tau per
(layer, element, KV head) (`tau_scope="head"`): at the prompt tau_0 = mean over the evicted
of their max similarity (Eq. 10, t = 0), at a decode step that evicts tau_t = beta *
max(U_t) + (1 - beta) * tau_{t-1} (unchanged at steps without one); an evicted entry merges
when its max similarity >= tau (tested after the update). Open reading `tau0`, for a head
that evicted nothing at the prompt (S_l >= n): "one" (default) sets tau_0 = 1, so its first
decode eviction merges only an exact duplicate; "first" leaves tau undefined, so its first
eviction sets tau = its own max similarity (no EMA) and merges. Weights (`merge_kind`):
  softmax (paper, Eq. 11-12): k_j <- (e k_j + sum_i exp(u_ij) k_i) / (e + sum_i exp(u_ij))
  mean    (code, lines 376-404): k_j <- (k_j + sum_i u_ij k_i) / (1 + #merged into j)
values with the same weights. The merged-into entry keeps its position and accumulated
score (the paper says nothing about it); an evicted slot's score is reset. The prefill keeps
each layer's whole prompt until `finalize`, because S_l needs every layer's F_v; the merge
there compares every prompt entry with the S kept slots ([B, K, n, S], never [n, n]).
`prefill_merge=False` evicts at the prompt without merging.

`d2o_code` (the code, `evict_at="first_step"`). Layer level (lines 630-640 and
`modeling_llama3_new.py:706-723`): each query head's *unbiased* variance of its column sums
(`attn_sum.var(dim=-1)`), min-max normalised across the heads of the layer
(`(v - min) / (max - min + 1e-6)`), then the mean over heads (`variance="head_minmax"`);
r_l = clamp(L * softmax_l(-F_v) * rho, 0.01, 1) with rho = budget / n; the excess over the
clamp is dropped, as in the code (`budget_gap` reports it). Nothing is evicted at the prompt
(the cache holds all n entries). At the first extension of the cache (the first decoding
step; context-only: the question chunk) the layer sizes are taken from the S entries live
then (n + 1; lines 323-327): H_l = floor(S * r_l * (1 - recent_ratio)) heavy entries with
the T sinks among them, M_l = floor(S * r_l * recent_ratio) recent, S_l = H_l + M_l; and
one bulk eviction *with merging* cuts each layer to S_l (lines 338-404, 646-657). Later
steps evict one entry per new token (lines 660-667). Layers `< full_first` and `>= L -
full_last` are never compressed (line 653: layers 0, 1 and L-1; the code applies the same
indices to its 32- and 40-layer models, so the rule is a count from each end, not a
fraction of the depth: the first two and the last layer at every depth). A layer whose S_l
>= S evicts nothing at the first step and is never compressed again (no branch of lines
646-667 fires for it). One threshold per (layer, element) (`tau_scope="layer"`, line 311):
tau_0 = the mean over heads and evicted entries of their max similarity (line 371), then
tau_t = (1 - beta) tau_{t-1} + beta * mean (line 375; the code's alpha = belta = 0.5);
the p-th evicted entry of every head (position order) merges when the mean over heads of
their max similarities is >= tau (line 376), so at a decode step all heads merge or none.

Deviations from the code: the cache is per KV head (the code repeats
GQA keys per query head and evicts per query head; identical for MHA; here GQA scores are
the mean over the group); a layer whose S_l is n or n - 1 re-enters the code's first-step
branch at later steps (line 646) and adds the prompt's column sums again, misaligned with
its compacted cache -- here it evicts one entry per step like every other layer; the
ratios are fp32 (the code computes them in the model's dtype); H_l is raised to T when the
floors give fewer (the code would keep H_l of the T sinks).

Fixed shapes. `d2o_code` allocates n + question + max_new slots (its whole layers grow).
The engine runs its first extension (the question chunk, else the first decoding step) as
one program with the bulk step and the later steps as another, with one row per head and
step (`extension_phases`); called outside the engine its decode hook chooses the bulk step
under `lax.cond` on a step counter (`steps`, counted by `after_step`). The bulk step's
nearest-neighbour search is blockwise over the sources (`nearest_blocked`, [block, C] at
once); its merge rewrites the layer's rows, so the hook returns `Rows` of C rows at every
step (the other steps fill one row per new token and drop the rest): a per-layer row
scatter, never a copy of the cache, but C rows where `d2o` writes one (measured on CPU,
the bundled model, n = 2048, the same 2248 slots: ~1.3-1.6x the `d2o` step under the
`lax.cond`; the engine's two programs write one row a step after the first). `d2o` keeps
the decode step of a plain evictor: at most T (new tokens) entries per head go per step,
U_t is [B, K, T, C], and only the merge targets' rows are written.

Method state: acc [L,B,K,C], tau [L,B,K] ("head") or [L,B] ("layer"), budget S_l and
recent M_l [L,B], whole [L,B] (layers kept whole), merges / discards [L,B] (decode only;
the prefill's are in the stats); `d2o_code` adds ratio r_l, sized_from S [L,B] and steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.compression import budgets, scoring, selection
from kvjax.compression.eviction import DecodeEviction, query_sum
from kvjax.compression.layer import LayerIO, LayerKV, Rows
from kvjax.config import ModelConfig
from kvjax.methods.d2o.merging import MERGES, merge, nearest, nearest_blocked
from kvjax.methods.registry import register

VARIANCES = ("raw", "head_minmax")
CAP_EXCESS = ("redistribute", "drop")
TAU0 = ("one", "first")
ROUNDINGS = ("floor", "ceil")
TAU_SCOPES = ("head", "layer")
EVICT_AT = ("prefill", "first_step")


def waterfill(a_L, lo, hi, target):
    """Integer layer sizes s [L] in [lo, hi] summing to `target`, proportional to a [L]
    where the bounds allow (`budgets.water_fill`), rounded by largest remainder."""
    return budgets.largest_remainder(budgets.water_fill(a_L, lo, hi, target), hi, target)


@register
@dataclasses.dataclass(frozen=True)
class D2O(DecodeEviction):
    """D2O, paper defaults (D2O paper Sec. 4-5): variance-softmax layer sizes summing to
    budget * L (Eq. 5, 13), T=4 sinks, N:M = 3:1, EMA-threshold (beta 0.7) merging with
    softmax weights (Eq. 9-12), at the prompt and at every decoding step. See the module
    docstring for every parameter and open reading."""

    name: ClassVar[str] = "d2o"
    forced_what: ClassVar[str] = "the sinks and recent window"
    budget: int = 128
    sinks: int = 4
    recent_ratio: float = 0.25  # M / (N + M): N:M = 3:1
    recent_round: str = "floor"  # open reading: M_l = floor or ceil((S_l - T) * ratio)
    beta: float = 0.7
    merge: bool = True
    merge_kind: str = "softmax"
    prefill_merge: bool = True
    tau0: str = "one"  # open reading: tau_0 of a head that evicted nothing at the prompt
    tau_scope: str = "head"  # "layer": one threshold per layer on the mean over heads (code)
    variance_layers: bool = True  # Eq. 4-5 layer sizes S_l; False: S_l = budget
    variance: str = "raw"
    cap: float = 2.0  # static slots = min(n, ceil(cap * budget)): the largest S_l
    cap_excess: str = "redistribute"  # open reading: "drop" loses what the cap cuts
    evict_at: str = "prefill"  # "first_step": the code's schedule (module docstring)
    full_first: int = 0  # layers l < full_first are never compressed (code: 2)
    full_last: int = 0  # layers l >= L - full_last are never compressed (code: 1)
    gqa: str = "mean"
    block: int = 256

    @property
    def forced(self) -> int:
        return self.sinks + 1

    def validate(self, n: int, cfg: ModelConfig) -> None:
        for field, allowed in (("merge_kind", MERGES), ("variance", VARIANCES),
                               ("cap_excess", CAP_EXCESS), ("tau0", TAU0),
                               ("recent_round", ROUNDINGS), ("tau_scope", TAU_SCOPES),
                               ("evict_at", EVICT_AT)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r}; allowed: {allowed}")
        if not 0 < self.recent_ratio < 1:
            raise ValueError(f"recent_ratio={self.recent_ratio} outside (0, 1)")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"beta={self.beta} outside [0, 1]")
        if not self.cap > 0:
            raise ValueError(f"cap={self.cap} must be > 0")
        if self.full_first < 0 or self.full_last < 0 or (
                self.full_first + self.full_last >= cfg.num_layers):
            raise ValueError(
                f"full_first={self.full_first}, full_last={self.full_last}: each >= 0 and "
                f"together < num_layers={cfg.num_layers} (at least one compressed layer)")
        super().validate(n, cfg)

    # ---- shapes -------------------------------------------------------------------------

    def whole_layers(self, L: int) -> np.ndarray:
        """[L] bool: the layers never compressed, `full_first` from the front and `full_last`
        from the back at every depth (the code's layers 0, 1 and L-1: (2, 1))."""
        layer = np.arange(L)
        return (layer < self.full_first) | (layer >= L - self.full_last)

    # "any": the first extension under a `lax.cond` on the step counter (one program);
    # "first" / "later": the engine's two programs (`extension_phases`)
    phase: ClassVar[str] = "any"

    def extension_phases(self):
        if self.evict_at != "first_step" or self.phase != "any":
            return None
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return _phased(type(self), "first")(**fields), _phased(type(self), "later")(**fields)

    def _grows(self) -> bool:
        """Some layer may keep every entry and grow while decoding."""
        return self.evict_at == "first_step" or self.full_first > 0 or self.full_last > 0

    def kept_slots(self, n: int) -> int:
        if self._grows():
            return n
        return min(n, math.ceil(self.cap * self.budget))

    def decode_capacity(self, kept: int, question: int, max_new: int) -> int:
        if self._grows():
            return kept + question + max_new
        return super().decode_capacity(kept, question, max_new)

    # ---- layer sizes --------------------------------------------------------------------

    def layer_variance(self, acc, valid):
        """F_v [B] of one layer from its per-query-head column sums acc [B, K, G, T] over the
        valid prompt columns valid [B, T] (Eq. 4; `variance` in the module docstring)."""
        B = acc.shape[0]
        cols = valid[:, None, None, :]
        cnt = jnp.sum(valid, axis=-1)[:, None, None].astype(jnp.float32)
        mean = jnp.sum(jnp.where(cols, acc, 0.0), axis=-1) / jnp.maximum(cnt, 1.0)
        ss = jnp.sum(jnp.where(cols, (acc - mean[..., None]) ** 2, 0.0), axis=-1)
        if self.variance == "raw":
            return jnp.mean((ss / jnp.maximum(cnt, 1.0)).reshape(B, -1), axis=-1)
        var = (ss / jnp.maximum(cnt - 1.0, 1.0)).reshape(B, -1)  # torch.var: unbiased
        lo, hi = jnp.min(var, axis=-1, keepdims=True), jnp.max(var, axis=-1, keepdims=True)
        return jnp.mean((var - lo) / (hi - lo + 1e-6), axis=-1)

    def layer_sizes(self, fv_LB, n_B, slots: int):
        """The paper's S_l [L, B] (int32) and budget_gap [B] = budget * (compressed layers) -
        their sum S_l, from F_v [L, B] and the prompt lengths n [B] (Eq. 5 and 13;
        `cap_excess`). Whole layers (`whole_layers`) keep n and are outside the sum."""
        L, B = fv_LB.shape
        whole = self.whole_layers(L)
        comp = np.flatnonzero(~whole)
        alpha = (L * jax.nn.softmax(-fv_LB, axis=0) if self.variance_layers
                 else jnp.ones((L, B), jnp.float32))
        a = alpha * self.budget
        lo = self.forced + 1
        target = self.budget * len(comp)
        if self.cap_excess == "drop":
            s = jnp.clip(jnp.floor(a).astype(jnp.int32), lo, n_B[None])
            s = jnp.minimum(s, slots)
        else:
            hi = jnp.minimum(n_B, slots)
            fill = jax.vmap(waterfill, in_axes=(1, None, 0, None), out_axes=1)
            s = jnp.zeros((L, B), jnp.int32).at[comp].set(fill(a[comp], lo, hi, target))
        s = jnp.where(jnp.asarray(whole)[:, None], n_B[None], s)
        return s, target - jnp.sum(s[comp], axis=0)

    def recent_count(self, s_LB):
        """M_l = max(1, floor or ceil((S_l - T) * recent_ratio)) (Eq. 7-8; `recent_round`)."""
        x = (s_LB - self.sinks) * self.recent_ratio
        x = jnp.ceil(x) if self.recent_round == "ceil" else jnp.floor(x)
        return jnp.maximum(1, x.astype(jnp.int32))

    def code_ratios(self, fv_LB, n_B):
        """r_l = clamp(L * softmax(-F_v) * rho, 0.01, 1), rho = budget / n (the code's
        `modeling_llama3_new.py:706-714`; `variance_layers=False`: r_l = rho)."""
        L = fv_LB.shape[0]
        rho = self.budget / n_B.astype(jnp.float32)
        if not self.variance_layers:
            return jnp.broadcast_to(rho[None], fv_LB.shape)
        return jnp.clip(jax.nn.softmax(-fv_LB, axis=0) * L * rho[None], 0.01, 1.0)

    # ---- the threshold and the merge decision -------------------------------------------

    def threshold(self, gone, u, prev, initial: bool):
        """tau after an eviction of `gone` [B, K, E] with max similarities u [B, K, E]; prev
        [B, K] ("head") or [B] ("layer"), NaN: undefined. `initial`: the first eviction of
        the schedule (the prompt; the code's first step): the mean of u (Eq. 10, t = 0);
        otherwise the EMA of max u ("head", Eq. 10) or of the mean over heads ("layer",
        the code's `max_values.mean()`), started from the statistic when prev is NaN.
        Unchanged where nothing was evicted."""
        if self.tau_scope == "head":
            cnt = jnp.sum(gone, axis=-1)
            stat = (jnp.sum(jnp.where(gone, u, 0.0), axis=-1) / jnp.maximum(cnt, 1) if initial
                    else jnp.max(jnp.where(gone, u, -jnp.inf), axis=-1))
        else:
            cnt = jnp.sum(gone, axis=(-2, -1))
            stat = jnp.sum(jnp.where(gone, u, 0.0), axis=(-2, -1)) / jnp.maximum(cnt, 1)
        upd = stat if initial else jnp.where(
            jnp.isnan(prev), stat, self.beta * stat + (1 - self.beta) * prev)
        return jnp.where(cnt > 0, upd, prev)

    def merging(self, gone, u, tau):
        """Which of the evicted `gone` [B, K, E] (each head's in position order) merge:
        u >= tau per head ("head"), or, per rank p, the mean over the heads of their p-th
        evicted entry's u >= tau ("layer", the code's line 376)."""
        if self.tau_scope == "head":
            return gone & (u >= tau[..., None])
        B, K, E = gone.shape
        rank = jnp.where(gone, jnp.cumsum(gone, axis=-1) - 1, E)
        b = jnp.arange(B)[:, None, None]
        tot = jnp.zeros((B, E)).at[b, rank].add(jnp.where(gone, u, 0.0), mode="drop")
        cnt = jnp.zeros((B, E)).at[b, rank].add(gone.astype(jnp.float32), mode="drop")
        mean = tot / jnp.maximum(cnt, 1.0)
        return gone & (jnp.take_along_axis(mean, jnp.minimum(rank, E - 1).reshape(B, -1),
                                           axis=-1).reshape(B, K, E) >= tau[:, None, None])

    # ---- prefill ------------------------------------------------------------------------

    def after_layer_prefill(self, io: LayerIO, state):
        valid = io.valid[:, 0]
        acc = scoring.cumulative_attention(io.q, io.k, io.qpos, valid, io.pos, io.valid,
                                           self.block, io.tiled, io.lse)  # [B, K, G, T]
        red = jnp.where(io.valid, scoring.gqa_reduce(acc, self.gqa), 0.0)
        return io.kv, (red, self.layer_variance(acc, valid)), state  # finalize: every F_v

    def finalize(self, kv: LayerKV, aux, state):
        acc, fv = aux  # [L, B, K, T], [L, B]
        L, B, K, T = kv.pos.shape
        n_B = jnp.sum(kv.valid[0, :, 0], axis=-1, dtype=jnp.int32)
        whole = jnp.broadcast_to(jnp.asarray(self.whole_layers(L))[:, None], (L, B))
        z = jnp.zeros((L, B), jnp.int32)
        tau_shape = (L, B, K) if self.tau_scope == "head" else (L, B)
        if self.evict_at == "first_step":
            r = self.code_ratios(fv, n_B)
            state = {"acc": acc, "tau": jnp.full(tau_shape, jnp.nan, jnp.float32), "ratio": r,
                     "budget": z, "recent": z, "whole": whole, "sized_from": z,
                     "prompt": n_B, "steps": jnp.int32(0), "merges": z, "discards": z}
            live = jnp.sum(kv.valid, axis=-1, dtype=jnp.int32)
            return kv, state, {"layer_budgets": jnp.moveaxis(live, 1, 0),
                               "layer_ratios": jnp.moveaxis(r, 1, 0)}
        S = self.kept_slots(T)
        s_LB, gap = self.layer_sizes(fv, n_B, S)
        m_LB = self.recent_count(s_LB)
        tau_init = 1.0 if self.tau0 == "one" else jnp.nan

        def layer(k, v, pos, valid, acc, s_B, m_B):
            top = jnp.max(jnp.where(valid, pos, -1), axis=-1, keepdims=True)
            forced = valid & ((pos < self.sinks) | (pos > top - m_B[:, None, None]))
            sc = jnp.where(forced, jnp.inf, jnp.where(valid, acc, -jnp.inf))
            idx, live = selection.slots_from_scores(sc, jnp.broadcast_to(s_B[:, None], (B, K)), S)
            keep = selection.mark(valid.shape, idx, live, reduce="max") & valid
            gone = valid & ~keep
            # gather first, then merge every prompt entry against the S kept slots:
            # [B, K, T, S] similarities, not [B, K, T, T]
            g = selection.gather_kept(LayerKV(k, v, pos, valid), idx, live)
            near = nearest(g.k, g.valid, k)
            tau = self.threshold(gone, near[1], jnp.full(tau_shape[1:], tau_init, jnp.float32),
                                 True)
            ok = self.merging(gone, near[1], tau)
            gk, gv, merged, _ = merge(g.k, g.v, g.valid, k, v, gone, tau, self.merge_kind,
                                      self.merge and self.prefill_merge, near, ok=ok)
            a = jnp.where(g.valid, jnp.take_along_axis(acc, idx, axis=-1), 0.0)
            nm = jnp.sum(merged, axis=(-1, -2))
            return (LayerKV(gk, gv, g.pos, g.valid), a, tau, nm,
                    jnp.sum(gone, axis=(-1, -2)) - nm)

        # one layer at a time (lax.map, not vmap): each holds [B, K, T, S] similarities, so
        # all at once were L times that (20 GB for Qwen2.5-0.5B at B 8, T 4096, 40% kept)
        g, a, tau, nm, nd = jax.lax.map(lambda xs: layer(*xs),
                                        (kv.k, kv.v, kv.pos, kv.valid, acc, s_LB, m_LB))
        state = {"acc": a, "tau": tau, "budget": s_LB, "recent": m_LB, "whole": whole,
                 "merges": z, "discards": z}
        live = jnp.sum(g.valid, axis=-1, dtype=jnp.int32)
        stats = {"layer_budgets": jnp.moveaxis(live, 1, 0),  # [B, L, K] live after prefill
                 "layer_sizes": jnp.moveaxis(s_LB, 1, 0),  # [B, L]: S_l
                 "budget_gap": gap,  # [B]: budget * L - sum S_l (what bounds still drop)
                 "prefill_merges": jnp.moveaxis(nm, 1, 0),
                 "prefill_discards": jnp.moveaxis(nd, 1, 0), "tau0": jnp.moveaxis(tau, 1, 0)}
        return g, state, stats

    def pad_state(self, st, capacity: int):
        acc = st["acc"]
        return {**st, "acc": jnp.pad(acc, [(0, 0)] * 3 + [(0, capacity - acc.shape[-1])])}

    # ---- decode -------------------------------------------------------------------------

    def after_step(self, cfg: ModelConfig, cache, st):
        return {**st, "steps": st["steps"] + 1} if "steps" in st else st

    def decode_layer(self, io: LayerIO, probs, st):
        take, put = io.at_layer, io.set_layer
        acc = take(st["acc"]) + scoring.gqa_reduce(query_sum(probs, io.qvalid), self.gqa)
        lay = {key: take(st[key]) for key in ("tau", "budget", "recent", "whole")}
        if self.evict_at == "prefill" or self.phase == "later":
            k, v, kept, acc, new, nm, nd = self._evict(io, acc, lay, pad=False)
        elif self.phase == "first":
            lay["ratio"], lay["sized_from"] = take(st["ratio"]), take(st["sized_from"])
            k, v, kept, acc, new, nm, nd = self._bulk(io, acc, lay)
        else:  # the first extension evicts in bulk; one compiled program for both
            lay["ratio"], lay["sized_from"] = take(st["ratio"]), take(st["sized_from"])
            k, v, kept, acc, new, nm, nd = jax.lax.cond(
                st["steps"] == 0, lambda: self._bulk(io, acc, lay),
                lambda: self._evict(io, acc, lay, pad=True))
        st = {**st, "acc": put(st["acc"], acc), **{key: put(st[key], x) for key, x in new.items()},
              "merges": put(st["merges"], take(st["merges"]) + nm),
              "discards": put(st["discards"], take(st["discards"]) + nd)}
        # positions never change: returned as they came, so the engine writes nothing back
        return LayerKV(k, v, io.pos, kept), st

    def _evict(self, io: LayerIO, acc, lay, pad: bool):
        """One decoding step (or a later chunk) of one layer: the `live - S_l` lowest-scoring
        evictable entries of each head go (at most T, the new tokens), and merge or are
        discarded (Eq. 8-12; the code's lines 338-404 with one entry)."""
        top = jnp.max(jnp.where(io.valid, io.pos, -1), axis=-1, keepdims=True)
        evictable = (io.valid & (io.pos >= self.sinks)
                     & (io.pos <= top - lay["recent"][:, None, None]))
        live = jnp.sum(io.valid, axis=-1, dtype=jnp.int32)
        excess = jnp.where(lay["whole"][:, None], 0, jnp.maximum(live - lay["budget"][:, None], 0))
        C = io.k.shape[-2]
        T = min(io.q.shape[1], C)
        gone = selection.evict_lowest(acc, evictable, excess, T)
        kept = io.valid & ~gone
        # at most T entries of a head go per step: their slots by position, then U_t (their
        # similarities with the kept ones) -- [B, K, T, C], never [B, K, C, C]
        src = (jnp.argmax(gone, axis=-1)[..., None] if T == 1  # XLA:CPU's top_k sorts: 1 ms
               else jax.lax.top_k(jnp.where(gone, -io.pos.astype(jnp.float32), -jnp.inf), T)[1])
        ks, vs = (jnp.take_along_axis(x, src[..., None], axis=-2) for x in (io.k, io.v))
        near = nearest(io.k, kept, ks)
        gone_src = jnp.take_along_axis(gone, src, axis=-1)
        tau = self.threshold(gone_src, near[1], lay["tau"], False)
        ok = self.merging(gone_src, near[1], tau)
        k, v, merged, _ = merge(io.k, io.v, kept, ks, vs, gone_src, tau, self.merge_kind,
                                self.merge, near, rows=True, ok=ok)
        if pad and not isinstance(k, Rows):  # merge=False: no row changes
            nothing = Rows(jnp.full(src.shape, C, jnp.int32),
                           jnp.zeros((*src.shape, io.k.shape[-1]), io.k.dtype))
            k, v = nothing, nothing
        if pad:  # the bulk step's shape: C rows, the rest dropped (index C)
            k, v = (Rows(jnp.pad(r.idx, [(0, 0), (0, 0), (0, C - T)], constant_values=C),
                         jnp.pad(r.new, [(0, 0), (0, 0), (0, C - T), (0, 0)])) for r in (k, v))
        nm = jnp.sum(merged, axis=(-1, -2), dtype=jnp.int32)
        nd = jnp.sum(gone, axis=(-1, -2), dtype=jnp.int32) - nm
        new = {"tau": tau} if not pad else {**{x: lay[x] for x in lay}, "tau": tau}
        return k, v, kept, jnp.where(gone, 0.0, acc), new, nm, nd

    def _bulk(self, io: LayerIO, acc, lay):
        """The code's first step (lines 323-327, 338-404 after 646-657): sizes from the S
        live entries, then each head keeps its T sinks, its M_l newest and the top H_l - T
        of the rest; every other entry merges into its nearest kept one (decided on the
        layer's threshold) or is discarded."""
        B, K, C, _ = io.k.shape
        S = jnp.sum(io.valid[:, 0], axis=-1, dtype=jnp.int32)  # [B] (all heads alike)
        r = lay["ratio"]
        Sf = S.astype(jnp.float32)
        hh = jnp.floor((r * (1 - self.recent_ratio)) * Sf).astype(jnp.int32)
        m = jnp.floor((r * self.recent_ratio) * Sf).astype(jnp.int32)
        s = jnp.maximum(hh, self.sinks) + m
        whole = lay["whole"] | (s >= S)
        top = jnp.max(jnp.where(io.valid, io.pos, -1), axis=-1, keepdims=True)
        forced = io.valid & ((io.pos < self.sinks) | (io.pos > top - m[:, None, None]))
        sc = jnp.where(forced, jnp.inf, jnp.where(io.valid, acc, -jnp.inf))
        order = jax.lax.top_k(sc, C)[1]  # best first
        keep = selection.mark(io.valid.shape, order, jnp.arange(C) < s[:, None, None])
        keep = jnp.where(whole[:, None, None], io.valid, keep & io.valid)
        gone = io.valid & ~keep
        near = nearest_blocked(io.k, keep, self.block)
        tau = self.threshold(gone, near[1], lay["tau"], True)
        ok = self.merging(gone, near[1], tau)
        k, v, merged, _ = merge(io.k, io.v, keep, io.k, io.v, gone, tau, self.merge_kind,
                                self.merge, near, ok=ok)
        idx = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, K, C))
        nm = jnp.sum(merged, axis=(-1, -2), dtype=jnp.int32)
        nd = jnp.sum(gone, axis=(-1, -2), dtype=jnp.int32) - nm
        new = {**lay, "tau": tau, "budget": s, "recent": m, "whole": whole, "sized_from": S}
        return Rows(idx, k), Rows(idx, v), keep, jnp.where(gone, 0.0, acc), new, nm, nd

    def decode_stats(self, host, st) -> dict:
        """`d2o_code`: the sizes decided at the first step ([B, L]; whole layers: S, the
        entries they held then), whole layers, and budget_gap [B] = rho * S * L - sum S_l
        (the clamp, the floors and the whole layers); {} before any step."""
        if "steps" not in st or int(st["steps"]) == 0:
            return {}
        whole = np.asarray(st["whole"])
        S = np.asarray(st["sized_from"])
        s = np.where(whole, S, np.asarray(st["budget"]))
        L = s.shape[0]
        rho_S = self.budget * S[0] / np.asarray(st["prompt"])  # rho * S, rho = budget / n
        return {"layer_sizes": s.T.tolist(), "layer_whole": whole.T.tolist(),
                "budget_gap": (rho_S * L - s.sum(0)).tolist()}


@functools.cache
def _phased(cls: type, phase: str) -> type:
    """`cls` running only its first extension ("first") or only the later ones ("later"):
    another class, so the engine's compile cache tells the two programs apart."""
    return dataclasses.dataclass(frozen=True)(type(f"{cls.__name__}_{phase}", (cls,),
                                                   {"phase": phase, "__module__": __name__}))


@register
@dataclasses.dataclass(frozen=True)
class D2OCode(D2O):
    """D2O as the authors' code runs it (AIoT-MLSys-Lab/d2o, modeling_llama3_7b_13b_d2o.py):
    no eviction at the prompt, one bulk eviction with merging at the first decoding step
    from sizes of S = n + 1, one per step after; the code's variance and clamped ratios;
    1:1 heavy:recent, beta 0.5, mean merge, one threshold per layer; layers 0, 1, L-1
    never compressed (the module docstring has the line numbers)."""

    name: ClassVar[str] = "d2o_code"
    recent_ratio: float = 0.5
    beta: float = 0.5
    merge_kind: str = "mean"
    tau_scope: str = "layer"
    variance: str = "head_minmax"
    evict_at: str = "first_step"
    full_first: int = 2
    full_last: int = 1


@register
@dataclasses.dataclass(frozen=True)
class D2OUniformLayers(D2O):
    """D2O ablation "uniform layer sizes": every layer keeps S_l = budget (Eq. 4-5's
    variance allocation off, `variance_layers=False`); sinks, recent window, heavy hitters
    and merging as D2O: the paper's Table 6 row "w.o. Layer Operation". With `d2o_no_merge`
    it tells which of D2O's two parts a loss comes from."""

    name: ClassVar[str] = "d2o_uniform_layers"
    variance_layers: bool = False


@register
@dataclasses.dataclass(frozen=True)
class D2ONoMerge(D2O):
    """D2O ablation "no merging": D2O's layer sizes and eviction, every evicted entry
    discarded (Eq. 9-12 off, `merge=False`): the part the paper credits for beating H2O's
    pure eviction (Sec. 5.6); not a row of its Table 6, which keeps the merging."""

    name: ClassVar[str] = "d2o_no_merge"
    merge: bool = False
