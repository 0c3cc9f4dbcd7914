"""ASL (adaptive selection layer) and the layer-wise baselines of its tables, FastKV and
GemFilter (ASL paper; docs/methods.md "ASL"; authors' code TANIGUCHIREI/ASL).

ASL scores tokens at every prefill layer by pooled window attention (Sec. 4.1: window 32,
avgpool 7 counting the padding, softmax in fp32, summed over the window, over the query
heads of a GQA group and over KV heads), ranks them (1-based, descending), and from
`L_min` on computes the mean over the union of each observed layer's top-(k - w) tokens of
the variance of their ranks across the last `L_obs` layers. The first layer where
`var / var(L_min) < tau = 0.3` selects the top-(k - w) tokens of its ranking plus the
window; only they go on to deeper layers.

Depth: `L_min = floor(L/3)` (the paper's rule, Appendix D) and `L_obs = round(8 L / 32)`,
at least 2 (the paper's 8 on 32-layer Llama, scaled as every layer-indexed default here:
docs/methods.md "Conventions"); 8 on an L = 12 model would reach back to layer 0 at
L_min = 4. Budget: `select_k` = KV entries per layer and KV head, window included; by
default 1/16 of the longest prompt (the paper's 2048 of 32k), resolved per batch
(`for_prompt`).

Readings the paper leaves open, each a parameter (default first, as the authors' code):
- `span`: "algorithm" -- the window holds the L_obs layers l-L_obs+1..l (Algorithm 2 and
  the code); "equation" -- L_obs+1 layers l-L_obs..l (Sec. 4.1's union and variance);
- `variance`: "population" (the code's mean of squared deviations) or "sample" (ddof 1);
- `head_ranking`: "summed" -- one ranking of the scores summed over KV heads (Sec. 4.1 and
  the code); "per_head" -- each KV head's own ranking (Algorithm 1, line 9's RankDesc of
  P in R^{B x Hk x n}), the union and variances per head, their mean over heads;
- `rank_from`: "layer0" -- ranks kept from layer 0, so the window at L_min reaches back
  before it (the code); "l_min" -- ranks only from L_min on (Appendix D: ASL "starts the
  operation" at L_min), the initial variance then at L_min + 1, the first window of two
  layers.
Ties rank by position (stable sort: the code's torch.argsort is unstable, so exact ties
are arbitrary there); the hidden states are gathered after the selection layer's MLP and
keep their original positions. On a model shallower than `L_min + L_obs`, the window holds
the layers that exist (the code would index negative layers).

When tau is never crossed the paper selects nothing. Every layer then keeps a SnapKV
selection of `select_k` per KV head with ASL's own scores (the paper's "ASL + SnapKV"
row does this before the selection layer anyway): `asl_full_before` and `asl_2pass`,
which keep whole layers before the selection, fall back to it at the end of the prefill,
so the budget holds; the stats say so (`selected` false, `fallback_snapkv` true).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.compression import budgets
from kvjax.config import ModelConfig
from kvjax.methods.asl.layerwise import LayerwiseSelection, descending_ranks
from kvjax.methods.registry import register

SPANS = ("algorithm", "equation")
VARIANCES = ("population", "sample")
HEAD_RANKINGS = ("summed", "per_head")
RANK_FROM = ("layer0", "l_min")


@register
@dataclasses.dataclass(frozen=True)
class ASL(LayerwiseSelection):
    """ASL 1-pass + SnapKV (the paper's main row): every layer keeps `select_k` entries per
    KV head (SnapKV top-(k - w) by group-summed pooled scores + the window) up to the
    selection layer; deeper layers run on, and keep, the `select_k` selected tokens. The
    budget is `select_k` per (layer, KV head), window included."""

    name: ClassVar[str] = "asl"
    adaptive: ClassVar[bool] = True
    select_k: int | None = None  # None: `select_fraction` of the longest prompt
    select_fraction: float = 1 / 16  # the paper's 2048 of 32k
    window: int = 32
    kernel: int = 7
    pooling: str = "avg"
    tau: float = 0.3
    l_min: int | None = None  # None: floor(L / 3)
    l_obs: int | None = None  # None: round(8 L / 32), at least 2
    fallback_layer: int | None = None  # the paper has none: never crossing tau = no selection
    span: str = "algorithm"
    variance: str = "population"
    head_ranking: str = "summed"
    rank_from: str = "layer0"

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if self.select_k is None:
            return self.for_prompt(n).validate(n, cfg)
        super().validate(n, cfg)
        if not 0 < self.tau < 1:
            raise ValueError(f"tau={self.tau} outside (0, 1)")
        if not 0 <= self.lmin(cfg) < cfg.num_layers:
            raise ValueError(f"l_min={self.l_min} outside [0, {cfg.num_layers})")
        if self.l_obs is not None and self.l_obs < 2:
            raise ValueError(f"l_obs={self.l_obs}: the rank variance needs >= 2 layers")
        if self.fallback_layer is not None and not 0 <= self.fallback_layer < cfg.num_layers:
            raise ValueError(f"fallback_layer={self.fallback_layer} outside [0, {cfg.num_layers})")
        for field, allowed in (("span", SPANS), ("variance", VARIANCES),
                               ("head_ranking", HEAD_RANKINGS), ("rank_from", RANK_FROM)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r}; allowed: {allowed}")

    def with_budget(self, budget: int) -> "ASL":
        return dataclasses.replace(self, select_k=budget, budget=None)  # the paper: both equal

    def for_prompt(self, n: int) -> "ASL":
        if self.select_k is not None:
            return self
        if not 0 < self.select_fraction <= 1:
            raise ValueError(f"select_fraction={self.select_fraction} outside (0, 1]")
        # of the bucket's length, not n: one select_k, one compilation, per bucket
        k = min(int(budgets.length_scale(n) * self.select_fraction), n)
        return dataclasses.replace(self, select_k=max(k, self.window + 1))

    def lmin(self, cfg: ModelConfig) -> int:
        return cfg.num_layers // 3 if self.l_min is None else self.l_min

    def lobs(self, cfg: ModelConfig) -> int:
        return max(2, round(8 * cfg.num_layers / 32)) if self.l_obs is None else self.l_obs

    def init_exit(self, cfg: ModelConfig, P: int):
        W = self.lobs(cfg) + (self.span == "equation")
        K = cfg.num_kv_heads if self.head_ranking == "per_head" else 1
        return (jnp.zeros((W, K, P), jnp.float32), jnp.full((W,), -1, jnp.int32),
                jnp.float32(jnp.nan))

    def exit_test(self, layer, s_KP, valid_P, ex, cfg: ModelConfig):
        ring, held, init_var = ex  # ranks [W, K', P] of the layers `held` [W]
        W = ring.shape[0]
        s = jnp.sum(s_KP, axis=0, keepdims=True) if ring.shape[1] == 1 else s_KP
        ring = ring.at[layer % W].set(jax.vmap(descending_ranks)(s))
        held = held.at[layer % W].set(layer)
        l_min = self.lmin(cfg)
        start = 0 if self.rank_from == "layer0" else l_min
        live = (held >= start) & (held > layer - W)  # [W]
        count = jnp.sum(live)
        lv = live[:, None, None]
        union = jnp.any(lv & (ring <= self.select_k - self.window), axis=0)  # [K', P]
        mu = jnp.sum(jnp.where(lv, ring, 0), axis=0) / count
        ss = jnp.sum(jnp.where(lv, (ring - mu) ** 2, 0), axis=0)
        var_t = ss / (count - (self.variance == "sample"))
        var = jnp.sum(jnp.where(union, var_t, 0)) / jnp.maximum(jnp.sum(union), 1)
        observed = (layer >= l_min) & (count >= 2)
        init_var = jnp.where(observed & jnp.isnan(init_var), var, init_var)
        rel = jnp.where(observed, var / init_var, jnp.nan)
        hit = observed & (rel < self.tau)
        if self.fallback_layer is not None:
            hit |= layer == self.fallback_layer
        return hit, (ring, held, init_var), rel

    def exit_stats(self, ex, relvar) -> dict:
        # crossed tau, as opposed to selecting at `fallback_layer` (NaN compares False)
        return {"init_var": ex[2], "tau_crossed": jnp.any(relvar < self.tau),
                "l_obs": jnp.int32(ex[0].shape[0])}


@register
@dataclasses.dataclass(frozen=True)
class ASLFullBefore(ASL):
    """ASL with the full KV kept up to the selection layer (the paper's comparison with
    FastKV on prefill): layers <= selection keep every prompt entry, deeper layers keep
    the `select_k` selected tokens."""

    name: ClassVar[str] = "asl_full_before"
    kv_before: str = "full"


@register
@dataclasses.dataclass(frozen=True)
class ASL2Pass(ASL):
    """ASL 2-pass (ASL + GemFilter): the first pass stops at the adaptive selection layer;
    the model then runs again from layer 0 on the `select_k` selected tokens, renumbered
    0..k-1 (`reposition`, as GemFilter's code does). Every layer keeps `select_k`."""

    name: ClassVar[str] = "asl_2pass"
    second_pass: bool = True


@register
@dataclasses.dataclass(frozen=True)
class FastKV(LayerwiseSelection):
    """FastKV (Jo et al., 2025; defaults from its code, docs/methods.md "ASL"): token-
    selective propagation at a fixed layer (15 of 32, scaled to the model's depth) of
    `tsp_rate` = 20% of the prompt; SnapKV-style retention of `budget` entries per layer
    and KV head (`kv_rate` = 10% of the prompt when no budget is given) with window 8,
    maxpool 7 and a mean over the GQA group, at every layer."""

    name: ClassVar[str] = "fastkv"
    select_k: int | None = None  # None: tsp_rate * prompt
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    gqa: str = "mean"
    layer_of_32: int = 15  # the TSP layer
    tsp_rate: float = 0.2
    kv_rate: float = 0.1

    def resolved(self, n: int) -> "FastKV":
        """Token counts from the rates, for a prompt of n tokens (the engine resolves them
        for the longest prompt of a batch, `for_prompt`; a padded length otherwise)."""
        scale = budgets.length_scale(n)  # the bucket's length: one compilation per bucket
        k = self.select_k if self.select_k is not None else min(int(self.tsp_rate * scale), n)
        b = self.budget if self.budget is not None else min(int(self.kv_rate * scale), n)
        return dataclasses.replace(self, select_k=k, budget=b)

    def for_prompt(self, n: int) -> "FastKV":
        return self.resolved(n)

    def validate(self, n: int, cfg: ModelConfig) -> None:
        LayerwiseSelection.validate(self.resolved(n), n, cfg)

    def kept_slots(self, n: int) -> int:
        return LayerwiseSelection.kept_slots(self.resolved(n), n)

    def token_plan(self, n: int):
        return LayerwiseSelection.token_plan(self.resolved(n), n)


@register
@dataclasses.dataclass(frozen=True)
class GemFilter(LayerwiseSelection):
    """GemFilter (Shi et al., 2024): at a fixed filter layer (13 of 32, scaled), score the
    prefix by the last query's raw q.k summed over all query heads (no softmax, no scale),
    avgpool 5 (docs/methods.md "ASL"), keep the top `select_k` (window = the last token), then run the
    whole model again on the selected tokens with positions 0..k-1; every layer keeps them."""

    name: ClassVar[str] = "gemfilter"
    select_k: int = 1024
    kernel: int = 5
    pooling: str = "avg"
    last_query_raw: bool = True
    second_pass: bool = True
    layer_of_32: int = 13  # the filter layer

    def with_budget(self, budget: int) -> "GemFilter":
        return dataclasses.replace(self, select_k=budget)
