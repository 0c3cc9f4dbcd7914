"""Layer-wise token selection during prefill: the hooks ASL, FastKV and GemFilter share.

The engine runs the two loops (`kvjax.engine.token_selection`): the full prompt layer by
layer until the exit test selects, then the selected tokens only. A method of this family
supplies the plan (`token_plan`), the per-token scores (`token_scores`) and the exit test
(`init_exit`, `exit_test`, `exit_stats`): ASL's rank-variance test, or a fixed layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kvjax import pallas
from kvjax.compression import scoring
from kvjax.compression.method import Method
from kvjax.config import ModelConfig
from kvjax.models import attention
from kvjax.pallas.dispatch import Kernels


def head_window_scores(
    q_BTHD: Float[Array, "B T H D"],
    k_BKTD: Float[Array, "B K T D"],
    valid_BT: Bool[Array, "B T"],
    window: int,
    kernel: int,
    pooling: str,
    softmax: bool = True,
) -> Float[Array, "B K G P"]:
    """Attention of the last `window` queries to the prefix columns [0, T - window), summed
    over the window and pooled; per query head, grouped by KV head (P = T - window).

    softmax=True: softmax over every key a window query sees (prefix and, causally, the
    window), fp32, at 1/sqrt(d). softmax=False: raw q.k (GemFilter).
    """
    T, D = q_BTHD.shape[1], q_BTHD.shape[-1]
    if softmax:
        s = scoring.window_attention(q_BTHD, k_BKTD, valid_BT, window, "sum")
    else:  # raw q.k: undo the logits' 1/sqrt(d)
        s = attention.logits(q_BTHD[:, T - window:], k_BKTD)[..., : T - window] * D**0.5
        s = jnp.sum(jnp.where(valid_BT[:, None, None, None, : T - window], s, 0.0), axis=3)
    return scoring.pool1d(s, kernel, pooling)


def descending_ranks(s_P: Float[Array, "P"]) -> Float[Array, "P"]:
    """1-based rank of each entry when sorted descending (stable: ties by position)."""
    order = jnp.argsort(-s_P, stable=True)
    return jnp.zeros_like(s_P).at[order].set(jnp.arange(1, s_P.shape[0] + 1, dtype=s_P.dtype))


@dataclasses.dataclass(frozen=True)
class TokenPlan:
    """The static shape of a token-selection prefill of one padded prompt length."""

    select_k: int  # tokens selected
    kv_budget: int  # KV kept per layer and KV head before the selection ("snapkv")
    window: int  # forced tail (1: GemFilter's last query)
    slots: int  # static cache slots per (layer, KV head)
    kv_before: str  # "snapkv" or "full"
    second_pass: bool
    adaptive: bool  # the loop may end without selecting
    reposition: bool


@dataclasses.dataclass(frozen=True)
class LayerwiseSelection(Method):
    """Base of the methods that select `select_k` tokens at some prefill layer.

    Subclasses set: how tokens are scored (`window`, `kernel`, `pooling`, `gqa`), which
    layer selects (`adaptive` rank-variance exit or the fixed `select_layer`), what layers
    before the selection keep (`kv_before`: "snapkv" = `select_k` per KV head, "full"),
    and what runs after (`second_pass`: GemFilter re-encodes the selected tokens from
    layer 0, `reposition` renumbering their positions 0..k-1).

    Hooks the engine's token-selection prefill calls: `token_plan(n)` (the static plan),
    `token_scores(q, k, valid, kernels)` ([B, K, P] per-head prefix scores),
    `init_exit(cfg, P)`, `exit_test(layer, s_KP, valid_P, state, cfg)` -> (select now?,
    state, relative variance) and `exit_stats(state, relvar)`.
    """

    name: ClassVar[str] = "layerwise"
    prefill_kind: ClassVar[str] = "token_selection"
    positional: ClassVar[bool] = False
    select_k: int = 2048
    window: int = 32
    kernel: int = 7
    pooling: str = "avg"
    kv_before: str = "snapkv"
    second_pass: bool = False
    reposition: bool = True
    select_layer: int | None = None  # fixed selection layer (FastKV, GemFilter) ...
    layer_of_32: int | None = None  # ... or given for a 32-layer Llama, scaled to the depth
    last_query_raw: bool = False  # GemFilter: last query, raw q.k, no softmax
    budget: int | None = None  # KV kept per layer and KV head (None: select_k)
    gqa: str = "sum"  # reduction over the query heads of a KV group: "sum" or "mean"

    # ---- validation ---------------------------------------------------------------------

    def validate(self, n: int, cfg: ModelConfig) -> None:
        w = 1 if self.last_query_raw else self.window
        if not w < self.select_k <= n:  # select_k = n keeps every token (a no-op selection)
            raise ValueError(
                f"select_k={self.select_k} must be > window={w} and <= the prompt length {n}")
        kv = self.kv_budget
        if not w < kv <= n:
            raise ValueError(f"budget={kv} must be > window={w} and <= the prompt length {n}")
        if self.kv_before not in ("snapkv", "full"):
            raise ValueError(f"kv_before={self.kv_before!r}; allowed: 'snapkv', 'full'")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"pooling={self.pooling!r}; allowed: 'avg', 'max'")
        layer = self.fixed_layer(cfg)
        if layer is not None and not 0 <= layer < cfg.num_layers:
            raise ValueError(f"select_layer={layer} outside [0, {cfg.num_layers})")

    @property
    def kv_budget(self) -> int:
        return self.select_k if self.budget is None else self.budget

    adaptive: ClassVar[bool] = False  # True: the loop may end without selecting

    def kept_slots(self, n: int) -> int:
        if self.kv_before == "full" or (self.second_pass and self.adaptive):
            return n  # full KV before selection, or no selection at all: all of it must fit
        if self.second_pass:
            return self.select_k
        return max(self.kv_budget, self.select_k)

    # ---- scoring and the exit test (ASL overrides) ------------------------------------------

    def budget_for(self, n: int) -> int | None:
        """`budget` where set, else the tokens selected (`with_budget` sets `select_k`)."""
        return self.budget if self.budget is not None else self.for_prompt(n).select_k

    def token_plan(self, n: int) -> TokenPlan:
        """The plan for a padded prompt of n tokens."""
        return TokenPlan(self.select_k, self.kv_budget, 1 if self.last_query_raw else self.window,
                         self.kept_slots(n), self.kv_before, self.second_pass, self.adaptive,
                         self.reposition)

    def token_scores(self, q, k, valid, kernels: Kernels) -> Float[Array, "B K P"]:
        """Per-KV-head token scores over the prefix (group-reduced)."""
        if not self.last_query_raw:  # the kernel op (`head_window_scores` above is its twin)
            return pallas.window_scores(q, k, valid, window=self.window, kernel=self.kernel,
                                        pooling=self.pooling, gqa=self.gqa, reduce="sum",
                                        implementation=kernels.window_scores)
        s = head_window_scores(q, k, valid, 1, self.kernel, self.pooling, softmax=False)
        return jnp.sum(s, axis=2) if self.gqa == "sum" else jnp.mean(s, axis=2)

    def init_exit(self, cfg: ModelConfig, P: int) -> Any:
        return ()

    def fixed_layer(self, cfg: ModelConfig) -> int | None:
        if self.select_layer is None and self.layer_of_32 is not None:
            return int(round(self.layer_of_32 * cfg.num_layers / 32))
        return self.select_layer

    def exit_test(self, layer, s_KP, valid_P, ex, cfg: ModelConfig):
        """From the layer's per-KV-head prefix scores [K, P] (padding -inf): (select now?,
        exit state, relative variance or nan)."""
        return layer == self.fixed_layer(cfg), ex, jnp.float32(jnp.nan)

    def exit_stats(self, ex, relvar) -> dict:
        """What the exit test adds to the stats (a fixed layer: nothing)."""
        return {}
