"""The engine's layer loops: the prompt through every layer, and new tokens on top of a cache.

Both are one `lax.scan` over the stacked layers (compile time does not grow with depth)
and call a method's hook after each layer's attention with a `LayerIO`: the prompt loop
(`prefill_layers`) lets a method compress layer by layer, so the full-prompt KV of all
layers never exists at once; the cache loop (`extend_layers`) serves decoding (T = 1)
and the context-only question chunk.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from kvjax import pallas
from kvjax.compression.cache import LayerKV, set_rows, write
from kvjax.compression.layer import LayerIO, Rows
from kvjax.config import ModelConfig
from kvjax.models import attention, transformer
from kvjax.pallas.dispatch import Kernels, note

Params = transformer.Params
# (LayerIO, state) -> (what the scan stores for this layer, state)
PrefillHook = Callable[[LayerIO, Any], tuple[Any, Any]]


def prefill_layers(
    params: Params,
    cfg: ModelConfig,
    tokens_BT: Int[Array, "B T"],
    valid_BT: Bool[Array, "B T"],
    pos_BT: Int[Array, "B T"],
    hook: PrefillHook,
    state: Any = None,
    kernels: Kernels = Kernels(),
):
    """Run the prompt through every layer (attention inside the prompt only).

    `hook` sees each layer's q/k/v and decides what to keep of them. Returns the hidden
    states after the last layer [B, T, D], the stacked per-layer hook outputs and the
    final hook state.
    """
    x = params["embed"][tokens_BT]
    B, T = tokens_BT.shape
    kpos_BKT = jnp.broadcast_to(pos_BT[:, None], (B, cfg.num_kv_heads, T))
    kvalid_BKT = jnp.broadcast_to(valid_BT[:, None], (B, cfg.num_kv_heads, T))

    def body(carry, xs):
        x, st = carry
        p, layer = xs
        q, k, v = transformer.qkv(p, cfg, x, pos_BT)
        window = transformer.layer_window(cfg, layer)
        # each query's log-sum-exp where the attention has it (the CPU's blocked one, the
        # fused call) and it is the causal softmax's over the whole prompt (no window):
        # H2O's column sums
        o, lse = attention.attend_prompt(q, k, v, pos_BT, kpos_BKT, kvalid_BKT, window,
                                         kernels.prompt_attention(q.dtype), ordered=True,
                                         with_lse=True)
        x = transformer.finish_layer(p, cfg, x, o)
        out, st = hook(LayerIO(layer, q, k, v, kpos_BKT, kvalid_BKT, pos_BT, o, x, valid_BT,
                               p["o"], cfg, kernels,
                               lse=lse if window is None else None), st)
        return (x, st), out

    layers = jnp.arange(cfg.num_layers)
    (x, state), outs = jax.lax.scan(body, (x, state),
                                    (transformer.stacked_layers(params), layers))
    return x, outs, state


def attend_cached(q_BTHD, k_BKCD, v_BKCD, ok_BKTC, kernels: Kernels):
    """Attention of new tokens over one layer's cache: one query goes to the
    `decode_attention` kernel op when the run's kernels pick one."""
    if q_BTHD.shape[1] == 1 and kernels.active("decode_attention"):
        o = pallas.decode_attention(q_BTHD[:, 0], k_BKCD, v_BKCD, ok_BKTC[:, :, 0],
                                    implementation=kernels.decode_attention)
        return o[:, None]
    if q_BTHD.shape[1] == 1:
        note("decode_attention", "xla")
    return attention.attend(q_BTHD, k_BKCD, v_BKCD, ok_BKTC)


def extend_layers(
    params: Params,
    cfg: ModelConfig,
    x_BTD: Array,
    valid_BT: Bool[Array, "B T"],
    kv: LayerKV,
    pos_BT: Int[Array, "B T"],
    slot_LBKT: Int[Array, "L B K T"] | Int[Array, ""],
    method=None,
    state: Any = None,
    kernels: Kernels = Kernels(),
    span: tuple[int, int] | None = None,
):
    """Append T tokens (their embeddings x [B, T, D]) to a cache (kv [L, B, K, C, ...]) and
    attend, through the layers of `span` (all of them by default).

    Decoding is T = 1; the context-only scenario prefills the question this way on top of
    a compressed context. The new entries are written into `slot_LBKT` first (a method that
    evicts while decoding picks the slot per layer and head; a scalar appends at that
    slot), so a token attends to itself
    and its chunk through the same position-based causal mask. `method` supplies the
    per-layer hooks (`revival` before the attention, `decode_layer` after it); None runs
    the plain model. A span [a, b) takes the hidden states entering layer a and returns
    those leaving layer b - 1 (a decode step split where a method works on the host).
    """
    x = x_BTD
    a, b = span or (0, cfg.num_layers)
    hook = method.decode_layer if method is not None and method.uses_decode_layer() else None

    def step(x, kv, st, layer):
        """One layer: (x, kv, st, the hook's Rows of this layer's k and v, or None)."""
        p = transformer.layer_slice(params, layer)
        if method is not None:
            kv, st = revive(p, layer, kv, st)
        q, k, v = transformer.qkv(p, cfg, x, pos_BT)
        kv = write(kv, layer, k, v, pos_BT, valid_BT,
                   slot_LBKT if jnp.ndim(slot_LBKT) == 0 else slot_LBKT[layer])
        lk, lv, lp, lval = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
                            for a in (kv.k, kv.v, kv.pos, kv.valid))
        ok = attention.mask(pos_BT, lp, lval, transformer.layer_window(cfg, layer))
        if hook is None:
            o = attend_cached(q, lk, lv, ok, kernels)
            return transformer.finish_layer(p, cfg, x, o), kv, st, (None, None)
        o, probs = attention.attend(q, lk, lv, ok, return_probs=True)
        x = transformer.finish_layer(p, cfg, x, o)
        io = LayerIO(layer, q, lk, lv, lp, lval, pos_BT, o, x, valid_BT, None, cfg, kernels)
        new, st = hook(io, probs, st)
        # what the hook returns unchanged is not written back: writing a slice of the
        # carry into itself makes XLA copy the whole [L, ...] array every layer
        fields = ("k", "v", "pos", "valid")
        kv = LayerKV(*(a if n is old or isinstance(n, Rows)
                       else jax.lax.dynamic_update_index_in_dim(a, n, layer, 0)
                       for a, old, n in zip((kv.k, kv.v, kv.pos, kv.valid), (lk, lv, lp, lval),
                                            (getattr(new, f) for f in fields))))
        return x, kv, st, tuple(n if isinstance(n, Rows) else None for n in (new.k, new.v))

    def revive(p, layer, kv, st):
        """The method's `revival` rows: their k and v at this layer, then the layer on them.
        Only the rows pass through the `lax.cond`: given the whole cache, XLA copies it."""
        rv = method.revival(layer, st)
        if rv is None:
            return kv, st
        same = lambda x: x  # noqa: E731
        C = kv.k.shape[-2]
        lk, lv, lp, lval = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
                            for a in (kv.k, kv.v, kv.pos, kv.valid))
        slot = jnp.broadcast_to(jnp.where(rv.active & (rv.slot >= 0), rv.slot, C)[:, None],
                                (*rv.slot.shape[:1], lk.shape[1], rv.slot.shape[1]))

        def run(_):
            x = jax.lax.cond(rv.mlp_first, lambda x: transformer.mlp_residual(
                transformer.layer_slice(params, jnp.maximum(layer - 1, 0)), cfg, x), same, rv.x)
            pos_BR = jnp.take_along_axis(lp[:, 0], jnp.clip(rv.slot, 0, C - 1), axis=1)
            q, k, v = transformer.qkv(p, cfg, x, pos_BR)
            S = rv.keys or C
            keys, vals = (set_rows(a[:, :, :S], (), slot, r) for a, r in ((lk, k), (lv, v)))
            o = attention.attend(q, keys, vals, attention.mask(
                pos_BR, lp[..., :S], lval[..., :S], transformer.layer_window(cfg, layer)))
            x = transformer.attention_residual(p, cfg, x, o)
            x = jax.lax.cond(rv.mlp_last, lambda x: transformer.mlp_residual(p, cfg, x), same, x)
            return k.astype(lk.dtype), v.astype(lv.dtype), x

        def skip(_):
            rows = jnp.zeros((*slot.shape, lk.shape[-1]), lk.dtype)
            return rows, rows, rv.x

        k_r, v_r, x = jax.lax.cond(rv.active, run, skip, None)
        kv = LayerKV(set_rows(kv.k, (layer,), slot, k_r), set_rows(kv.v, (layer,), slot, v_r),
                     kv.pos, kv.valid)
        return kv, method.revived(layer, x, st)

    def flush(kv, layer, rows):
        # Rows land at the start of the next layer's step, before anything reads the
        # cache, as `write` does: scattered right after the hook, XLA copies the whole
        # cache to keep it intact for readers it cannot order before the scatter
        k, v = (a if r is None else set_rows(a, (layer,), r.idx, r.new)
                for a, r in zip((kv.k, kv.v), rows))
        return LayerKV(k, v, kv.pos, kv.valid)

    def body(carry, layer):
        x, kv, st, rows = carry
        x, kv, st, new_rows = step(x, flush(kv, layer - 1, rows), st, layer)
        return (x, kv, st, new_rows), None

    C = kv.k.shape[-2]
    shapes = jax.eval_shape(step, x, kv, state, jnp.int32(a))[3]
    rows = jax.tree.map(lambda s: jnp.full(s.shape, C, s.dtype) if s.dtype == jnp.int32
                        else jnp.zeros(s.shape, s.dtype), shapes)  # nothing to flush
    (x, kv, state, rows), _ = jax.lax.scan(body, (x, kv, state, rows), jnp.arange(a, b))
    kv = flush(kv, b - 1, rows)
    return x, kv, state


def extend_per_layer(
    layers: tuple[Params, ...],
    cfg: ModelConfig,
    x_BTD: Array,
    valid_BT: Bool[Array, "B T"],
    kvs: tuple[LayerKV, ...],
    pos_BT: Int[Array, "B T"],
    slot_LBKT: Int[Array, "L B K T"] | tuple[Int[Array, "B K T"], ...] | Int[Array, ""],
    kernels: Kernels = Kernels(),
    method=None,
    state: Any = None,
):
    """`extend_layers` of a decode step over per-layer buffers: `layers` each layer's
    weights (`transformer.per_layer`), `kvs` each layer's entries [B, K, C, ...]
    (`kvjax.compression.cache.split_layers`); the T new entries are written at
    `slot_LBKT` (indexed by layer: each layer's [B, K, T] slots; a scalar: appended
    there). A Python loop, as jax-llm-examples decodes: every layer reads its own weights
    and KV where they lie, where the scan's slices of stacked arrays are copies on a GPU
    (`kvjax.bench.decode_layout`). `method`: its `decode_layer` hook after each layer's
    attention (`Method.layered_hooks`), with the layer number a constant. Returns
    (x [B, T, D], the new kvs, the state)."""
    x, out = x_BTD, []
    hook = method.decode_layer if method is not None and method.uses_decode_layer() else None
    per_layer = isinstance(slot_LBKT, tuple) or jnp.ndim(slot_LBKT) > 0
    for layer, (p, kv) in enumerate(zip(layers, kvs)):
        q, k, v = transformer.qkv(p, cfg, x, pos_BT)
        # in place, except at batch 1 on CPU (jax 0.10), where XLA fuses a second copy of
        # the append into the attention and copies the layer's K and V to feed both
        # (`kvjax.bench.decode_hlo`; an optimization barrier does not stop it)
        kv = write(kv, None, k, v, pos_BT, valid_BT,
                   slot_LBKT[layer] if per_layer else slot_LBKT)
        ok = attention.mask(pos_BT, kv.pos, kv.valid, transformer.layer_window(cfg, layer))
        if hook is None:
            x = transformer.finish_layer(p, cfg, x, attend_cached(q, kv.k, kv.v, ok, kernels))
            out.append(kv)
            continue
        o, probs = attention.attend(q, kv.k, kv.v, ok, return_probs=True)
        x = transformer.finish_layer(p, cfg, x, o)
        io = LayerIO(jnp.int32(layer), q, kv.k, kv.v, kv.pos, kv.valid, pos_BT, o, x, valid_BT,
                     None, cfg, kernels)
        new, state = hook(io, probs, state)
        # a layer's own buffers: its rows scatter in place at once (the scan defers them)
        out.append(LayerKV(*(set_rows(a, (), n.idx, n.new) if isinstance(n, Rows) else n
                             for a, n in zip(kv, (new.k, new.v, new.pos, new.valid)))))
    return x, tuple(out), state
