"""ASL (adaptive selection layer) and the layer-wise baselines of its tables, FastKV and
GemFilter (ASL paper; docs/methods.md "ASL"; authors' code TANIGUCHIREI/ASL).

ASL scores tokens at every prefill layer by pooled window attention (Eq. 1: window 32,
avgpool 7 counting the padding, softmax in fp32, summed over the window, over the query
heads of a GQA group and over KV heads -- Eq. 2), ranks them (1-based, descending), and
from `L_min = floor(L/3)` on computes the mean over the union of each observed layer's
top-(k - w) tokens of the population variance of their ranks across the last `L_obs = 8`
layers (Eq. 3). The first layer where `var / var(L_min) < tau = 0.3` (Eq. 4) selects the
top-(k - w) tokens of its ranking plus the window; only they go on to deeper layers.

Where the paper is silent, the authors' code decides: ranks are computed from layer 0 on
(the observation window at L_min reaches back before it); ties rank by position (stable
sort: the code's torch.argsort is unstable, so exact ties are arbitrary there); the hidden
states are gathered after the selection layer's MLP and keep their original positions.
On a model shallower than `L_min + L_obs`, the window holds the layers that exist
(`max(0, l - L_obs + 1) .. l`) -- the code would index negative layers.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.methods.asl.layerwise import LayerwiseSelection, descending_ranks
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class ASL(LayerwiseSelection):
    """ASL 1-pass + SnapKV (the paper's main row): every layer keeps `select_k` entries per
    KV head (SnapKV top-(k - w) by group-summed pooled scores + the window) up to the
    selection layer; deeper layers run on, and keep, the `select_k` selected tokens. The
    budget is `select_k` per (layer, KV head), window included."""

    name: ClassVar[str] = "asl"
    adaptive: ClassVar[bool] = True
    select_k: int = 2048
    window: int = 32
    kernel: int = 7
    pooling: str = "avg"
    tau: float = 0.3
    l_min: int | None = None  # None: floor(L / 3)
    l_obs: int = 8
    fallback_layer: int | None = None  # the paper has none: never crossing tau = no selection

    def validate(self, n: int, cfg: ModelConfig) -> None:
        super().validate(n, cfg)
        if not 0 < self.tau < 1:
            raise ValueError(f"tau={self.tau} outside (0, 1)")
        if not 0 <= self.lmin(cfg) < cfg.num_layers:
            raise ValueError(f"l_min={self.l_min} outside [0, {cfg.num_layers})")
        if self.l_obs < 2:
            raise ValueError(f"l_obs={self.l_obs}: the rank variance needs >= 2 layers")
        if self.fallback_layer is not None and not 0 <= self.fallback_layer < cfg.num_layers:
            raise ValueError(f"fallback_layer={self.fallback_layer} outside [0, {cfg.num_layers})")

    def with_budget(self, budget: int) -> "ASL":
        return dataclasses.replace(self, select_k=budget, budget=None)  # the paper: both equal

    def lmin(self, cfg: ModelConfig) -> int:
        return cfg.num_layers // 3 if self.l_min is None else self.l_min

    def init_exit(self, cfg: ModelConfig, P: int):
        return jnp.zeros((self.l_obs, P), jnp.float32), jnp.float32(jnp.nan)

    def exit_test(self, layer, s_P, valid_P, ex, cfg: ModelConfig):
        ring, init_var = ex
        ring = ring.at[layer % self.l_obs].set(descending_ranks(s_P))
        count = jnp.minimum(layer + 1, self.l_obs)
        live = (jnp.arange(self.l_obs) < count)[:, None]  # slots of layers max(0,l-L_obs+1)..l
        union = jnp.any(live & (ring <= self.select_k - self.window), axis=0)
        mu = jnp.sum(jnp.where(live, ring, 0), axis=0) / count
        var_t = jnp.sum(jnp.where(live, (ring - mu) ** 2, 0), axis=0) / count
        var = jnp.sum(jnp.where(union, var_t, 0)) / jnp.maximum(jnp.sum(union), 1)
        l_min = self.lmin(cfg)
        init_var = jnp.where(layer == l_min, var, init_var)
        observed = layer >= l_min
        rel = jnp.where(observed, var / init_var, jnp.nan)
        hit = observed & (rel < self.tau)
        if self.fallback_layer is not None:
            hit |= layer == self.fallback_layer
        return hit, (ring, init_var), rel

    def exit_stats(self, ex, relvar) -> dict:
        # crossed tau, as opposed to selecting at `fallback_layer` (NaN compares False)
        return {"init_var": ex[1], "tau_crossed": jnp.any(relvar < self.tau)}


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
        """Token counts from the rates, for a prompt (bucket) of n tokens."""
        k = self.select_k if self.select_k is not None else int(self.tsp_rate * n)
        b = self.budget if self.budget is not None else int(self.kv_rate * n)
        return dataclasses.replace(self, select_k=k, budget=b)

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
