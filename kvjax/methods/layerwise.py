"""Layer-wise token selection during prefill: ASL, FastKV, GemFilter share this machinery.

The prefill runs as two compiled loops over the stacked layers, per batch element (vmap):

1. a `lax.while_loop` over layers on the full prompt. After each layer it scores the
   tokens, stores what that layer keeps of its KV, and evaluates the exit test (ASL's
   rank-variance test or a fixed layer). Its condition holds the test, so the layer at
   which the loop stops is data, not a Python branch;
2. a second loop on the `k` selected tokens only: either the remaining layers on the
   hidden states gathered after the selection layer's MLP (one pass, original RoPE
   positions kept), or all layers again from the embeddings of the selected tokens
   (GemFilter's second pass, positions renumbered 0..k-1 by default).

Every selection layer and every prompt of the same padded length share one compilation;
under vmap each batch element stops at its own layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax import pallas, scoring
from kvjax.config import ModelConfig
from kvjax.methods.base import Method
from kvjax.models import attention, transformer


def window_scores(
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


def top_with_window(s_P: Float[Array, "P"], k: int, window: int) -> Int[Array, "k"]:
    """Indices (ascending) of the top `k - window` prefix entries plus the window."""
    P = s_P.shape[0]
    top = jax.lax.top_k(s_P, k - window)[1]
    return jnp.sort(jnp.concatenate([top, jnp.arange(P, P + window)]))


@dataclasses.dataclass(frozen=True)
class LayerwiseSelection(Method):
    """Base of the methods that select `select_k` tokens at some prefill layer.

    Subclasses set: how tokens are scored (`window`, `kernel`, `pooling`, `gqa`), which
    layer selects (`adaptive` rank-variance exit or the fixed `select_layer`), what layers
    before the selection keep (`kv_before`: "snapkv" = `select_k` per KV head, "full"),
    and what runs after (`second_pass`: GemFilter re-encodes the selected tokens from
    layer 0, `reposition` renumbering their positions 0..k-1).
    """

    name: ClassVar[str] = "layerwise"
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

    def scores(self, q, k, valid) -> Float[Array, "B K P"]:
        """Per-KV-head token scores over the prefix (group-reduced)."""
        if not self.last_query_raw:  # the kernel op (`window_scores` below is its twin)
            return pallas.window_scores(q, k, valid, window=self.window, kernel=self.kernel,
                                        pooling=self.pooling, gqa=self.gqa, reduce="sum")
        s = window_scores(q, k, valid, 1, self.kernel, self.pooling, softmax=False)
        return jnp.sum(s, axis=2) if self.gqa == "sum" else jnp.mean(s, axis=2)

    def init_exit(self, cfg: ModelConfig, P: int) -> Any:
        return ()

    def fixed_layer(self, cfg: ModelConfig) -> int | None:
        if self.select_layer is None and self.layer_of_32 is not None:
            return int(round(self.layer_of_32 * cfg.num_layers / 32))
        return self.select_layer

    def exit_test(self, layer, s_P, valid_P, ex, cfg: ModelConfig):
        """-> (select now?, exit state, relative variance or nan)."""
        return layer == self.fixed_layer(cfg), ex, jnp.float32(jnp.nan)

    def exit_stats(self, ex, relvar) -> dict:
        """What the exit test adds to the stats (a fixed layer: nothing)."""
        return {}

    # ---- the prefill ------------------------------------------------------------------------

    def prefill(self, params, cfg: ModelConfig, tokens_BT, valid_BT, pos_BT):
        fn = jax.vmap(lambda t, v, p: self._prefill_one(params, cfg, t[None], v[None], p[None]))
        x, kv, stats = fn(tokens_BT, valid_BT, pos_BT)
        # vmap put the batch first: (B, L, 1, K, S, ..) -> (L, B, K, S, ..)
        kv = tuple(jnp.moveaxis(a[:, :, 0], 0, 1) for a in kv)
        return x[:, 0], kv, None, stats

    def _prefill_one(self, params, cfg: ModelConfig, tokens, valid, pos):
        """One element (batch dim 1): (last hidden [1, D], per-layer kv, stats)."""
        L, K, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        T = tokens.shape[1]
        w = 1 if self.last_query_raw else self.window
        P, k_sel, S = T - w, self.select_k, self.kept_slots(T)
        kv_keep = min(self.kv_budget, S)
        kpos = jnp.broadcast_to(pos[:, None], (1, K, T))
        kvalid = jnp.broadcast_to(valid[:, None], (1, K, T))
        dt = params["embed"].dtype
        kv0 = (jnp.zeros((L, 1, K, S, Dh), dt), jnp.zeros((L, 1, K, S, Dh), dt),
               jnp.zeros((L, 1, K, S), jnp.int32), jnp.zeros((L, 1, K, S), bool))
        put = lambda kv, l, new: tuple(jax.lax.dynamic_update_index_in_dim(a, n, l, 0)
                                       for a, n in zip(kv, new))

        def padded(a, n):
            return jnp.pad(a, [(0, 0), (0, 0), (0, S - n)] + [(0, 0)] * (a.ndim - 3))

        def keep_layer(s_KP, k, v):
            """What a layer on the full prompt keeps: all of it, or SnapKV's top per head."""
            if self.second_pass and not self.adaptive:  # the second pass rewrites every layer
                return tuple(jnp.zeros(a.shape[1:], a.dtype) for a in kv0)
            if self.kv_before == "full" or self.second_pass or kv_keep >= T:
                return tuple(padded(a, T) for a in (k, v, kpos, kvalid))
            idx = jax.vmap(lambda x: top_with_window(x, kv_keep, w))(s_KP)[None]  # [1, K, kv_keep]
            g = lambda a: jnp.take_along_axis(a, idx[..., None] if a.ndim == 4 else idx, axis=2)
            return tuple(padded(g(a), kv_keep) for a in (k, v, kpos, kvalid))

        # ---- loop 1: full prompt, until the exit test selects -------------------------------
        def cond1(c):
            l, *_, done = c
            return (l < L) & ~done

        def body1(c):
            l, x, kv, ex, x_sel, idx_sel, relvar, done = c
            p = transformer.layer_slice(params, l)
            q, k, v = transformer.qkv(p, cfg, x, pos)
            o = attention.attend_chunked(q, k, v, pos, kpos, kvalid, cfg.sliding_window)
            x = transformer.finish_layer(p, cfg, x, o)
            s_KP = jnp.where(valid[0, :P], self.scores(q, k, valid)[0], -jnp.inf)
            kv = put(kv, l, keep_layer(s_KP, k, v))
            s = jnp.sum(s_KP, axis=0)  # one score per token [P]
            hit, ex, rv = self.exit_test(l, s, valid[0, :P], ex, cfg)
            idx = top_with_window(s, k_sel, w)
            x_sel = jnp.where(hit, x[:, idx], x_sel)
            idx_sel = jnp.where(hit, idx, idx_sel)
            relvar = relvar.at[l].set(rv)
            return l + 1, x, kv, ex, x_sel, idx_sel, relvar, hit

        D = cfg.hidden_size
        init1 = (jnp.int32(0), params["embed"][tokens], kv0, self.init_exit(cfg, P),
                 jnp.zeros((1, k_sel, D), dt), jnp.zeros((k_sel,), jnp.int32),
                 jnp.full((L,), jnp.nan, jnp.float32), jnp.bool_(False))
        l1, x, kv, ex, x_sel, idx_sel, relvar, selected = jax.lax.while_loop(cond1, body1, init1)
        sel_layer = jnp.where(selected, l1 - 1, -1)

        # ---- loop 2: the k selected tokens ---------------------------------------------------
        sel_pos = pos[:, idx_sel]
        if self.second_pass:
            start = jnp.where(selected, 0, L)
            x2 = jnp.where(selected, params["embed"][tokens[:, idx_sel]], x_sel)
            if self.reposition:
                sel_pos = jnp.arange(k_sel, dtype=jnp.int32)[None]
        else:
            start, x2 = l1, x_sel
        spos = jnp.broadcast_to(sel_pos[:, None], (1, K, k_sel))
        svalid = jnp.ones((1, K, k_sel), bool)

        def body2(c):
            l, x, kv = c
            p = transformer.layer_slice(params, l)
            q, k, v = transformer.qkv(p, cfg, x, sel_pos)
            o = attention.attend(q, k, v, attention.mask(sel_pos, spos, svalid, cfg.sliding_window))
            kv = put(kv, l, tuple(padded(a, k_sel) for a in (k, v, spos, svalid)))
            return l + 1, transformer.finish_layer(p, cfg, x, o), kv

        _, x2, kv = jax.lax.while_loop(lambda c: c[0] < L, body2, (start, x2, kv))
        last = jnp.where(selected, x2[:, -1], x[:, -1])
        stats = {"selection_layer": sel_layer, "selected": selected, "select_k": jnp.int32(k_sel),
                 "relative_variance": relvar, **self.exit_stats(ex, relvar)}
        return last, kv, stats
