"""Llama 3.x / Mistral / Qwen2 / Qwen3 as pure functions over a parameter pytree.

The families differ only by config flags (q/k/v bias, q/k RMSNorm, rope scaling, sliding
window), so there is one definition. Layers are stacked on a leading axis and run with
`lax.scan`: compile time does not grow with depth, and per-layer behaviour of a method is
data indexed by the scanned layer number.

Params (shapes with L layers, D hidden, H query heads, K KV heads, Dh head dim, F mlp):
  embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
  layers: attn_norm [L, D], q [L, D, H*Dh], k/v [L, D, K*Dh], o [L, H*Dh, D],
          q_bias [L, H*Dh], k_bias/v_bias [L, K*Dh] (Qwen2), q_norm/k_norm [L, Dh] (Qwen3),
          mlp_norm [L, D], gate/up [L, D, F], down [L, F, D]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache import set_rows, write
from kvjax.config import ModelConfig
from kvjax.models import attention
from kvjax.models.rope import apply_rope, inv_freq

Params = dict[str, Any]


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def qkv(p: Params, cfg: ModelConfig, x_BTD: Array, pos_BT: Int[Array, "B T"]):
    """Projections, Qwen2 bias, Qwen3 q/k norm and RoPE: q [B,T,H,Dh], k/v [B,K,T,Dh]."""
    B, T, _ = x_BTD.shape
    h = rms_norm(x_BTD, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    freq = inv_freq(cfg)
    q, k = apply_rope(q, pos_BT, freq), apply_rope(k, pos_BT, freq)
    return q, k.swapaxes(1, 2), v.swapaxes(1, 2)


def finish_layer(p: Params, cfg: ModelConfig, x_BTD: Array, o_BTHD: Array) -> Array:
    """Residual after attention, then the SwiGLU MLP block."""
    B, T = x_BTD.shape[:2]
    x = x_BTD + o_BTHD.reshape(B, T, -1) @ p["o"]
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]


def unembed(params: Params, cfg: ModelConfig, x: Array) -> Float[Array, "... V"]:
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(h, w, preferred_element_type=jnp.float32)


def layer_slice(params: Params, layer: Int[Array, ""]) -> Params:
    """The parameters of one layer, by a (possibly traced) index."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False),
                        params["layers"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerIO:
    """What a method hook sees of one layer: everything the papers score with."""

    layer: Int[Array, ""]
    q: Float[Array, "B T H Dh"]  # RoPE applied
    k: Float[Array, "B K S Dh"]  # prefill: the prompt's keys; decode: the layer's cache slots
    v: Float[Array, "B K S Dh"]
    pos: Int[Array, "B K S"]  # original positions of those keys
    valid: Bool[Array, "B K S"]
    qpos: Int[Array, "B T"]
    o: Float[Array, "B T H Dh"]  # attention output before W_O
    hidden: Float[Array, "B T D"]  # residual stream after the layer
    qvalid: Bool[Array, "B T"] | None = None  # which queries are real tokens (not padding)
    wo: Float[Array, "HDh D"] | None = None  # the layer's W_O (prefill only; CriticalKV)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rows:
    """A decode hook's sparse update of one layer's k or v: rows `idx` [B, K, E] (C drops
    the row) set to `new` [B, K, E, Dh]. `extend` scatters it into the cache carry in place;
    a whole new [B, K, C, Dh] layer would cost a copy of the layer and its write-back."""

    idx: Int[Array, "B K E"]
    new: Float[Array, "B K E Dh"]

    def into(self, x: Float[Array, "B K C Dh"]) -> Float[Array, "B K C Dh"]:
        """x with the rows set (the dense equivalent of what `extend` writes)."""
        return set_rows(x, (), self.idx, self.new)


# (LayerIO, state) -> (what the scan stores for this layer, state)
PrefillHook = Callable[[LayerIO, Any], tuple[Any, Any]]
# (LayerIO, probs [B,K,G,T,C], state) -> ((k, v, pos, valid) of the layer, state); k and v
# may be Rows
DecodeHook = Callable[[LayerIO, Array, Any], tuple[Any, Any]]


def prefill(
    params: Params,
    cfg: ModelConfig,
    tokens_BT: Int[Array, "B T"],
    valid_BT: Bool[Array, "B T"],
    pos_BT: Int[Array, "B T"],
    hook: PrefillHook,
    state: Any = None,
):
    """Run the prompt through every layer (attention inside the prompt only).

    `hook` sees each layer's q/k/v and decides what to keep of them, so a method can
    compress layer by layer and the full-prompt KV of all layers never exists at once.
    Returns the hidden states after the last layer [B, T, D], the stacked per-layer hook
    outputs and the final hook state.
    """
    x = params["embed"][tokens_BT]
    B, T = tokens_BT.shape
    kpos_BKT = jnp.broadcast_to(pos_BT[:, None], (B, cfg.num_kv_heads, T))
    kvalid_BKT = jnp.broadcast_to(valid_BT[:, None], (B, cfg.num_kv_heads, T))

    def body(carry, xs):
        x, st = carry
        p, layer = xs
        q, k, v = qkv(p, cfg, x, pos_BT)
        o = attention.attend_chunked(q, k, v, pos_BT, kpos_BKT, kvalid_BKT, cfg.sliding_window)
        x = finish_layer(p, cfg, x, o)
        out, st = hook(LayerIO(layer, q, k, v, kpos_BKT, kvalid_BKT, pos_BT, o, x, valid_BT,
                                 p["o"]), st)
        return (x, st), out

    layers = jnp.arange(cfg.num_layers)
    (x, state), outs = jax.lax.scan(body, (x, state), (params["layers"], layers))
    return x, outs, state


def extend(
    params: Params,
    cfg: ModelConfig,
    tokens_BT: Int[Array, "B T"],
    valid_BT: Bool[Array, "B T"],
    kv: tuple[Array, Array, Array, Array],
    pos_BT: Int[Array, "B T"],
    slot_LBKT: Int[Array, "L B K T"],
    hook: DecodeHook | None = None,
    state: Any = None,
):
    """Append T tokens to a cache (k, v, pos, valid of shape [L, B, K, C, ...]) and attend.

    Decoding is T = 1; the context-only scenario prefills the question this way on top of
    a compressed context. The new entries are written into `slot_LBKT` first (a method that
    evicts while decoding picks the slot per layer and head), so a token attends to itself
    and its chunk through the same position-based causal mask.
    """
    x = params["embed"][tokens_BT]

    def step(x, kv, st, layer):
        """One layer: (x, kv, st, the hook's Rows of this layer's k and v, or None)."""
        p = layer_slice(params, layer)
        q, k, v = qkv(p, cfg, x, pos_BT)
        kv = write(kv, layer, k, v, pos_BT, valid_BT, slot_LBKT[layer])
        lk, lv, lp, lval = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in kv)
        ok = attention.mask(pos_BT, lp, lval, cfg.sliding_window)
        if hook is None:
            o = attention.attend(q, lk, lv, ok)
            return finish_layer(p, cfg, x, o), kv, st, (None, None)
        o, probs = attention.attend(q, lk, lv, ok, return_probs=True)
        x = finish_layer(p, cfg, x, o)
        io = LayerIO(layer, q, lk, lv, lp, lval, pos_BT, o, x, valid_BT)
        new_layer, st = hook(io, probs, st)
        # what the hook returns unchanged is not written back: writing a slice of the
        # carry into itself makes XLA copy the whole [L, ...] array every layer
        kv = tuple(a if n is old or isinstance(n, Rows)
                   else jax.lax.dynamic_update_index_in_dim(a, n, layer, 0)
                   for a, old, n in zip(kv, (lk, lv, lp, lval), new_layer))
        return x, kv, st, tuple(n if isinstance(n, Rows) else None for n in new_layer[:2])

    def flush(kv, layer, rows):
        # Rows land at the start of the next layer's step, before anything reads the
        # cache, as `write` does: scattered right after the hook, XLA copies the whole
        # cache to keep it intact for readers it cannot order before the scatter
        return tuple(a if r is None else set_rows(a, (layer,), r.idx, r.new)
                     for a, r in zip(kv, (*rows, None, None)))

    def body(carry, layer):
        x, kv, st, rows = carry
        x, kv, st, new_rows = step(x, flush(kv, layer - 1, rows), st, layer)
        return (x, kv, st, new_rows), None

    C = kv[0].shape[-2]
    shapes = jax.eval_shape(step, x, kv, state, jnp.int32(0))[3]
    rows = jax.tree.map(lambda s: jnp.full(s.shape, C, s.dtype) if s.dtype == jnp.int32
                        else jnp.zeros(s.shape, s.dtype), shapes)  # nothing to flush
    (x, kv, state, rows), _ = jax.lax.scan(body, (x, kv, state, rows),
                                           jnp.arange(cfg.num_layers))
    kv = flush(kv, cfg.num_layers - 1, rows)
    return x, kv, state
