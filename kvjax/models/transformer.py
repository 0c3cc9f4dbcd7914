"""Llama 3.x / Mistral / Qwen2 / Qwen3 as pure functions over a parameter pytree.

The families differ only by config flags (q/k/v bias, q/k RMSNorm, rope scaling, sliding
window), so there is one definition. Layers are stacked on a leading axis; the loops that
run them (with a method's hooks) are the engine's (`kvjax.engine.layers`), so compile time
does not grow with depth and per-layer behaviour of a method is data indexed by the
scanned layer number.

Params (shapes with L layers, D hidden, H query heads, K KV heads, Dh head dim, F mlp):
  embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
  layers: attn_norm [L, D], q [L, D, H*Dh], k/v [L, D, K*Dh], o [L, H*Dh, D],
          q_bias [L, H*Dh], k_bias/v_bias [L, K*Dh] (Qwen2), q_norm/k_norm [L, Dh] (Qwen3),
          mlp_norm [L, D], gate/up [L, D, F], down [L, F, D]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.config import ModelConfig
from kvjax.models.rope import apply_rope, attention_scaling, inv_freq

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
    freq, scale = inv_freq(cfg), attention_scaling(cfg)
    q, k = apply_rope(q, pos_BT, freq, scale), apply_rope(k, pos_BT, freq, scale)
    return q, k.swapaxes(1, 2), v.swapaxes(1, 2)


def attention_residual(p: Params, cfg: ModelConfig, x_BTD: Array, o_BTHD: Array) -> Array:
    """The residual stream after the attention block: x + o W_O."""
    B, T = x_BTD.shape[:2]
    return x_BTD + o_BTHD.reshape(B, T, -1) @ p["o"]


def mlp_residual(p: Params, cfg: ModelConfig, x_BTD: Array) -> Array:
    """The residual stream after the SwiGLU MLP block."""
    h = rms_norm(x_BTD, p["mlp_norm"], cfg.rms_norm_eps)
    return x_BTD + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]


def finish_layer(p: Params, cfg: ModelConfig, x_BTD: Array, o_BTHD: Array) -> Array:
    """Residual after attention, then the SwiGLU MLP block."""
    return mlp_residual(p, cfg, attention_residual(p, cfg, x_BTD, o_BTHD))


def unembed(params: Params, cfg: ModelConfig, x: Array) -> Float[Array, "... V"]:
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(h, w, preferred_element_type=jnp.float32)


def layer_window(cfg: ModelConfig, layer) -> int | Int[Array, ""] | None:
    """The sliding window of `layer` (a possibly traced index): None where no layer has
    one, the static window where every layer has it (Mistral), else per-layer data (Qwen2
    and Qwen3's `max_window_layers` / `layer_types`): the window on the sliding layers and
    a window no position reaches on the others, so the layer scan stays one program."""
    if cfg.sliding_window is None or cfg.sliding_layers is None:
        return cfg.sliding_window
    if isinstance(layer, int):
        return cfg.sliding_window if cfg.slides(layer) else None
    table = jnp.asarray([cfg.sliding_window if cfg.slides(i) else jnp.iinfo(jnp.int32).max
                         for i in range(cfg.num_layers)], jnp.int32)
    return table[layer]


# How the layers' weights are stored: "stacked" = params["layers"] is one dict of [L, ...]
# arrays (what a `lax.scan` over layers takes, and what the loaders read); "per_layer" =
# a tuple of L dicts, each layer's own buffers (`store_layers`), what decode's per-layer loop
# reads without a copy (`Kernels.decode_layers`; the split of a stacked model otherwise holds
# a second copy of every layer's weights for a whole generation: docs/results/speed.md).
LAYER_STORAGE = ("stacked", "per_layer")


def layer_storage(params: Params) -> str:
    return "per_layer" if isinstance(params["layers"], (tuple, list)) else "stacked"


def stacked_layers(params: Params) -> Params:
    """The layers' weights as [L, ...] arrays: as stored, or stacked from per-layer buffers
    (a copy inside the program that asks: a prefill's scan over a per-layer model)."""
    layers = params["layers"]
    if layer_storage(params) == "stacked":
        return layers
    return jax.tree.map(lambda *w: jnp.stack(w), *layers)


def as_stacked(params: Params) -> Params:
    """`params` with stacked layers: what `layer_slice` and the layer scans take. Programs
    call it once, outside their loops (inside one, a per-layer model would be stacked at
    every step)."""
    return {**params, "layers": stacked_layers(params)}


def per_layer(params: Params) -> tuple[Params, ...]:
    """Each layer's parameters as its own buffers: as stored, or split from the stacked
    [L, ...] weights (a copy) -- what a loop over layers reads without slicing the stacked
    arrays at every step."""
    layers = params["layers"]
    if layer_storage(params) == "per_layer":
        return tuple(layers)
    return tuple(jax.tree.map(lambda w: w[i], layers)
                 for i in range(jax.tree.leaves(layers)[0].shape[0]))


def store_layers(params: Params, storage: str) -> Params:
    """`params` with its layers stored as `storage` (one of LAYER_STORAGE), converted once
    here (the old buffers are freed when the caller drops `params`)."""
    if storage not in LAYER_STORAGE:
        raise ValueError(f"layer storage {storage!r}; allowed: {LAYER_STORAGE}")
    if storage == layer_storage(params):
        return params
    layers = per_layer(params) if storage == "per_layer" else stacked_layers(params)
    return {**params, "layers": layers}


def layer_slice(params: Params, layer: Int[Array, ""]) -> Params:
    """The parameters of one layer, by a (possibly traced) index, of stacked params
    (`as_stacked`)."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False),
                        params["layers"])
