"""The reference: SnapKV's pooled window scores in pure jnp (holds [B, H, window, T]).

The math lives here, in the op's reference, and `kvjax.compression.scoring` uses it (the
kernel ops never import the compression package: docs/design.md, "Kernels").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kvjax.models import attention

# the one place these choices are declared (methods and kernel ops validate against them)
GQA_REDUCTIONS = ("mean", "max", "sum")  # over the G query heads of a KV head
POOLINGS = ("avg", "max", "none")  # along the token axis
WINDOW_REDUCTIONS = ("mean", "sum")  # over the observation window's queries


def pool1d(x: Float[Array, "... n"], kernel: int, kind: str) -> Float[Array, "... n"]:
    """Stride-1 pooling along the last axis with `kernel // 2` padding, length unchanged.

    avg counts the zero padding (torch `avg_pool1d`'s default `count_include_pad=True`, so
    the edges are damped); max pads with -inf (torch `max_pool1d`). Odd kernels only.
    """
    if kind == "none" or kernel == 1:
        return x
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel={kernel} must be odd (same-length output)")
    pad = kernel // 2
    widths = [(0, 0)] * (x.ndim - 1) + [(pad, pad)]
    if kind == "avg":
        xp = jnp.pad(x, widths)
        c = jnp.cumsum(xp, axis=-1)
        c = jnp.pad(c, [(0, 0)] * (x.ndim - 1) + [(1, 0)])
        n = x.shape[-1]
        return (c[..., kernel: kernel + n] - c[..., :n]) / kernel
    if kind == "max":
        xp = jnp.pad(x, widths, constant_values=-jnp.inf)
        return jax.lax.reduce_window(xp, -jnp.inf, jax.lax.max, (1,) * (x.ndim - 1) + (kernel,),
                                     (1,) * x.ndim, "VALID")
    raise ValueError(f"pooling={kind!r}; allowed: {POOLINGS}")


def gqa_reduce(s: Float[Array, "B K G ..."], how: str) -> Float[Array, "B K ..."]:
    """Reduce over the G query heads that share a KV head (axis 2): mean, max or sum."""
    if how == "mean":
        return jnp.mean(s, axis=2)
    if how == "max":
        return jnp.max(s, axis=2)
    if how == "sum":
        return jnp.sum(s, axis=2)
    raise ValueError(f"gqa={how!r}; allowed: {GQA_REDUCTIONS}")


def mask_padding(s: Float[Array, "B K n"], valid: Bool[Array, "B n"]) -> Float[Array, "B K n"]:
    """-inf on padding columns so that no selection ever keeps them."""
    return jnp.where(valid[:, None, :], s, -jnp.inf)


def window_attention(
    q_BTHD: Float[Array, "B T H D"],
    k_BKTD: Float[Array, "B K T D"],
    valid_BT: Bool[Array, "B T"],
    window: int,
    reduce: str = "mean",
) -> Float[Array, "B K G P"]:
    """Attention of the last `window` queries to the prefix columns [0, P = T - window).

    Window query i (at column T - window + i) sees every live key up to itself; the softmax
    runs over all of them in float32 at 1/sqrt(d), then only the prefix columns are kept
    and reduced over the window (`mean` as kvpress/AdaKV, or `sum` as the SnapKV code).
    Holds [B, H, window, T] at most.
    """
    B, T, H, D = q_BTHD.shape
    K = k_BKTD.shape[1]
    qw = q_BTHD[:, T - window:]
    s = attention.logits(qw, k_BKTD)  # [B, K, G, w, T] float32, scaled
    causal = jnp.arange(T)[None, :] <= jnp.arange(T - window, T)[:, None]  # [w, T]
    ok = causal[None, None] & valid_BT[:, None, None, :]
    p = attention.softmax(s, jnp.broadcast_to(ok, (B, K, window, T)))[..., : T - window]
    if reduce == "mean":
        return jnp.mean(p, axis=3)
    if reduce == "sum":
        return jnp.sum(p, axis=3)
    raise ValueError(f"window reduce={reduce!r}; allowed: {WINDOW_REDUCTIONS}")


def snap_scores(
    q_BTHD: Float[Array, "B T H D"],
    k_BKTD: Float[Array, "B K T D"],
    valid_BT: Bool[Array, "B T"],
    window: int,
    kernel: int,
    pooling: str,
    gqa: str = "mean",
    reduce: str = "mean",
) -> Float[Array, "B K P"]:
    """SnapKV's pooled window score of every prefix column, per KV head.

    Order as in kvpress `SnapKVPress.score` and the AdaKV code: reduce over the window,
    pool per query head, then reduce over the GQA group. Padding columns score 0 here.
    """
    s = window_attention(q_BTHD, k_BKTD, valid_BT, window, reduce)
    return gqa_reduce(pool1d(s, kernel, pooling), gqa)


def window_scores(
    q_BTHD: Float[Array, "B T H D"],
    k_BKTD: Float[Array, "B K T D"],
    valid_BT: Bool[Array, "B T"],
    *,
    window: int,
    kernel: int,
    pooling: str,
    gqa: str,
    reduce: str,
) -> Float[Array, "B K P"]:
    return snap_scores(q_BTHD, k_BKTD, valid_BT, window, kernel, pooling, gqa, reduce)
