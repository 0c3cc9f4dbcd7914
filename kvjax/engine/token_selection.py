"""Prefill that selects tokens at one layer and runs deeper layers on them (ASL, FastKV,
GemFilter: `prefill_kind = "token_selection"`).

Two compiled loops over the stacked layers, per batch element (vmap):

1. a `lax.while_loop` over layers on the full prompt. After each layer the method scores
   the tokens (`token_scores`), the layer's KV is stored (all of it, or the method's
   SnapKV top per head), and the method's exit test (`exit_test`: ASL's rank variance, or
   a fixed layer) runs. The loop's condition holds the test, so the layer at which it
   stops is data, not a Python branch;
2. a second loop on the `k` selected tokens only: either the remaining layers on the
   hidden states gathered after the selection layer's MLP (one pass, original RoPE
   positions kept), or all layers again from the embeddings of the selected tokens
   (GemFilter's second pass, positions renumbered 0..k-1 by default).

Every selection layer and every prompt of the same padded length share one compilation;
under vmap each batch element stops at its own layer. The method supplies the plan
(`token_plan`), the scores and the exit test; the hooks are documented on
`kvjax.methods.asl.layerwise.LayerwiseSelection`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.compression.cache import LayerKV
from kvjax.compression.protocols import TokenSelection
from kvjax.compression.selection import top_with_window
from kvjax.config import ModelConfig
from kvjax.models import attention, transformer
from kvjax.pallas.dispatch import Kernels


def prefill(method: TokenSelection, params, cfg: ModelConfig, tokens_BT, valid_BT, pos_BT, kernels: Kernels):
    """-> (last hidden [B, D], per-layer kv [L, B, K, S, ...], None, stats)."""
    fn = jax.vmap(lambda t, v, p: _prefill_one(method, params, cfg, t[None], v[None], p[None],
                                               kernels))
    x, kv, stats = fn(tokens_BT, valid_BT, pos_BT)
    # vmap put the batch first: (B, L, 1, K, S, ..) -> (L, B, K, S, ..)
    kv = jax.tree.map(lambda a: jnp.moveaxis(a[:, :, 0], 0, 1), kv)
    return x[:, 0], kv, None, stats


def _prefill_one(m: TokenSelection, params, cfg: ModelConfig, tokens, valid, pos, kernels: Kernels):
    """One element (batch dim 1): (last hidden [1, D], per-layer kv, stats)."""
    L, K, Dh = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    T = tokens.shape[1]
    plan = m.token_plan(T)
    w, k_sel, S = plan.window, plan.select_k, plan.slots
    P = T - w
    kv_keep = min(plan.kv_budget, S)
    kpos = jnp.broadcast_to(pos[:, None], (1, K, T))
    kvalid = jnp.broadcast_to(valid[:, None], (1, K, T))
    dt = params["embed"].dtype
    kv0 = LayerKV(jnp.zeros((L, 1, K, S, Dh), dt), jnp.zeros((L, 1, K, S, Dh), dt),
                  jnp.zeros((L, 1, K, S), jnp.int32), jnp.zeros((L, 1, K, S), bool))
    put = lambda kv, l, new: jax.tree.map(  # noqa: E731
        lambda a, n: jax.lax.dynamic_update_index_in_dim(a, n, l, 0), kv, new)

    def padded(a, n):
        return jnp.pad(a, [(0, 0), (0, 0), (0, S - n)] + [(0, 0)] * (a.ndim - 3))

    def keep_layer(s_KP, k, v):
        """What a layer on the full prompt keeps: all of it, or the top per head."""
        if plan.second_pass and not plan.adaptive:  # the second pass rewrites every layer
            return jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), kv0)
        if plan.kv_before == "full" or plan.second_pass or kv_keep >= T:
            return LayerKV(*(padded(a, T) for a in (k, v, kpos, kvalid)))
        idx = jax.vmap(lambda x: top_with_window(x, kv_keep, w))(s_KP)[None]  # [1, K, kv_keep]
        g = lambda a: jnp.take_along_axis(a, idx[..., None] if a.ndim == 4 else idx, axis=2)
        return LayerKV(*(padded(g(a), kv_keep) for a in (k, v, kpos, kvalid)))

    # ---- loop 1: full prompt, until the exit test selects -----------------------------------
    def cond1(c):
        l, *_, done = c
        return (l < L) & ~done

    def body1(c):
        l, x, kv, ex, x_sel, idx_sel, relvar, fb, done = c
        p = transformer.layer_slice(params, l)
        q, k, v = transformer.qkv(p, cfg, x, pos)
        # ordered (attention.attend_blocked): the keys are the queries' own, in slot order
        o = attention.attend_prompt(q, k, v, pos, kpos, kvalid,
                                    transformer.layer_window(cfg, l),
                                    kernels.prompt_attention(q.dtype), ordered=True)
        x = transformer.finish_layer(p, cfg, x, o)
        s_KP = jnp.where(valid[0, :P], m.token_scores(q, k, valid, kernels)[0], -jnp.inf)
        kv = put(kv, l, keep_layer(s_KP, k, v))
        if fallback:  # every layer's SnapKV choice, kept in case no layer selects
            fb = fb.at[l].set(jax.vmap(lambda x: top_with_window(x, kv_keep, w))(s_KP))
        hit, ex, rv = m.exit_test(l, s_KP, valid[0, :P], ex, cfg)
        s = jnp.sum(s_KP, axis=0)  # one score per token [P]
        idx = top_with_window(s, k_sel, w)
        x_sel = jnp.where(hit, x[:, idx], x_sel)
        idx_sel = jnp.where(hit, idx, idx_sel)
        relvar = relvar.at[l].set(rv)
        return l + 1, x, kv, ex, x_sel, idx_sel, relvar, fb, hit

    # an adaptive method keeping whole layers before its selection falls back to SnapKV
    # at every layer when none selects (the budget must hold)
    fallback = plan.adaptive and (plan.kv_before == "full" or plan.second_pass) and kv_keep < T
    D = cfg.hidden_size
    init1 = (jnp.int32(0), params["embed"][tokens], kv0, m.init_exit(cfg, P),
             jnp.zeros((1, k_sel, D), dt), jnp.zeros((k_sel,), jnp.int32),
             jnp.full((L,), jnp.nan, jnp.float32),
             jnp.zeros((L, K, kv_keep) if fallback else (), jnp.int32), jnp.bool_(False))
    l1, x, kv, ex, x_sel, idx_sel, relvar, fb, selected = jax.lax.while_loop(cond1, body1,
                                                                             init1)
    sel_layer = jnp.where(selected, l1 - 1, -1)

    # ---- loop 2: the k selected tokens ---------------------------------------------------------
    sel_pos = pos[:, idx_sel]
    if plan.second_pass:
        start = jnp.where(selected, 0, L)
        x2 = jnp.where(selected, params["embed"][tokens[:, idx_sel]], x_sel)
        if plan.reposition:
            sel_pos = jnp.arange(k_sel, dtype=jnp.int32)[None]
    else:
        start, x2 = l1, x_sel
    spos = jnp.broadcast_to(sel_pos[:, None], (1, K, k_sel))
    svalid = jnp.ones((1, K, k_sel), bool)

    def body2(c):
        l, x, kv = c
        p = transformer.layer_slice(params, l)
        q, k, v = transformer.qkv(p, cfg, x, sel_pos)
        o = attention.attend(q, k, v, attention.mask(sel_pos, spos, svalid,
                                                     transformer.layer_window(cfg, l)))
        kv = put(kv, l, LayerKV(*(padded(a, k_sel) for a in (k, v, spos, svalid))))
        return l + 1, transformer.finish_layer(p, cfg, x, o), kv

    _, x2, kv = jax.lax.while_loop(lambda c: c[0] < L, body2, (start, x2, kv))
    if fallback:
        g = lambda a: jnp.take_along_axis(a, fb[:, None, ..., None] if a.ndim == 5  # noqa: E731
                                          else fb[:, None], axis=3)
        snap = LayerKV(*(jnp.pad(g(a), [(0, 0)] * 3 + [(0, S - kv_keep)] + [(0, 0)] *
                                 (a.ndim - 4)) for a in kv))
        kv = jax.tree.map(lambda a, b: jnp.where(selected, a, b), kv, snap)
    last = jnp.where(selected, x2[:, -1], x[:, -1])
    stats = {"selection_layer": sel_layer, "selected": selected, "select_k": jnp.int32(k_sel),
             "kv_budget": jnp.int32(plan.kv_budget),
             "fallback_snapkv": plan.adaptive & ~selected,
             "relative_variance": relvar, **m.exit_stats(ex, relvar)}
    return last, kv, stats
