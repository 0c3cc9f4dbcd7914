"""How many entries each layer and head keeps (docs/methods.md, "Conventions" and "Baselines").

`budget` is always entries per (layer, KV head), window and sinks included. Static
schedules (uniform, PyramidKV) are computed on the host in float64, exactly as kvpress
computes them in Python; data-dependent allocations (AdaKV's flattened top-k) run under
jit on the scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax.compression.heads import Heads, flat_top_mask
from kvjax.compression.selection import mark


def length_scale(n: int) -> int:
    """The prompt length a length-proportional default is computed from (ASL's and
    FastKV's token counts, SlimInfer's scaled schedule): n rounded up to one of four
    lengths per octave, the engine's padded length (`engine.inputs.bucket`), so every
    prompt of a bucket resolves to one value and one compilation. Exact at the grid's
    lengths (1024, 1280, 1536, 1792, 2048, ...), at most 25% above n elsewhere; n itself
    up to 16."""
    return n if n <= 16 else quarter_octave(n)


def quarter_octave(n: int) -> int:
    """n rounded up to one of four lengths per octave [2^k, 2^(k+1)) (n itself below 8)."""
    step = 2 ** max(n.bit_length() - 3, 0)
    return -(-n // step) * step


def water_fill(w_L: Float[Array, "L"], lo_L, hi_L, total) -> Float[Array, "L"]:
    """Real sizes x_l = clip(c w_l, lo_l, hi_l) summing to `total` (what a capped layer
    cannot hold goes to the others in proportion to their weights): D2O's layer sizes
    (Eq. 5 within the bounds) and LAVa's refilled layer budgets. sum_l clip(c w_l) is
    piecewise linear in c with kinks at lo / w and hi / w, so c is found exactly on the
    segment where the total lies. A total outside [sum lo, sum hi] puts every layer on the
    bound it crosses; a layer of weight 0 gets its `lo` unless the others are all at `hi`
    (give it hi = 0 to keep it at 0)."""
    L = w_L.shape[0]
    w = jnp.maximum(w_L.astype(jnp.float32), 1e-30)
    lo, hi = (jnp.broadcast_to(jnp.asarray(x, jnp.float32), (L,)) for x in (lo_L, hi_L))
    t = jnp.asarray(total, jnp.float32)
    kinks = jnp.sort(jnp.concatenate([lo / w, hi / w]))  # [2L]
    f = jnp.sum(jnp.clip(kinks[:, None] * w[None], lo, hi), axis=1)  # nondecreasing
    i = jnp.clip(jnp.searchsorted(f, t), 1, 2 * L - 1)  # the first kink with f >= t
    c0, c1, f0, f1 = kinks[i - 1], kinks[i], f[i - 1], f[i]
    c = jnp.clip(c0 + (t - f0) * (c1 - c0) / jnp.maximum(f1 - f0, 1e-30), kinks[0], kinks[-1])
    return jnp.clip(c * w, lo, hi)


def largest_remainder(x_L: Float[Array, "L"], hi_L, target) -> Int[Array, "L"]:
    """Integer sizes from real ones: the floors, plus one for the `target - sum floors`
    largest fractional parts among the layers below their `hi` (the lower layer first on
    ties), as many as there are such layers."""
    L = x_L.shape[0]
    fl = jnp.floor(x_L)
    s = fl.astype(jnp.int32)
    room = x_L < jnp.broadcast_to(jnp.asarray(hi_L, x_L.dtype), (L,))
    d = jnp.clip(jnp.asarray(target, jnp.int32) - jnp.sum(s), 0, jnp.sum(room))
    order = jnp.argsort(-jnp.where(room, x_L - fl, -1.0), stable=True)
    rank = jnp.zeros(L, jnp.int32).at[order].set(jnp.arange(L, dtype=jnp.int32))
    return s + (rank < d)


def uniform(budget: int, num_layers: int) -> np.ndarray:
    """[L] the same budget for every layer."""
    return np.full((num_layers,), budget, np.int32)


def pyramid(budget: float, n: int, num_layers: int, window: int, beta: float) -> np.ndarray:
    """[L] PyramidKV's linear schedule, exactly kvpress `PyramidKVPress.get_layer_budget`.

    PyramidKV (Cai et al. 2024; written out as LAVa paper Eq. 21): the last layer keeps
    `B / beta`, the first `2B - B / beta`, linear in between, so the mean over layers is
    the average budget `B`. kvpress's form (with `B = n (1 - ratio)` entries per layer,
    window included -- its `max_capacity_prompt - window_size`):

        min = B / beta;  max = 2B - min
        if max >= n - window:  max = n - window;  min = 2B - max
        if not (n >= max >= min >= window):  every layer keeps B   (fallback to SnapKV)
        layer l keeps round(max - l * (max - min) / (L - 1))      (round half to even)

    `n` is the prompt length. Python floats and `round`, as kvpress, so that the integers
    agree with it bit for bit. `budget` may be a float: kvpress's `B = n (1 - ratio)` is one
    (640 x (1 - 0.8) = 127.99999999999997), and rounding it to an integer first would keep
    one entry fewer than kvpress in some layers (`PyramidKV.with_ratio` passes it as is).
    """
    if beta < 1:
        raise ValueError(f"beta={beta} must be >= 1")
    b = float(budget)
    # kvpress's B is (window + n (1 - r)) - window: the same float as b for an integer
    # budget, possibly not for a fractional one, so it is computed the same way here
    span = (window + b) - window
    min_num = span / beta
    max_num = span * 2 - min_num
    if max_num >= n - window:
        max_num = n - window
        min_num = span * 2 - max_num
    if not (n >= max_num >= min_num >= window):
        return np.full((num_layers,), max(1, round(b)), np.int32)
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return np.array([round(max_num - l * steps) for l in range(num_layers)], np.int32)


def pyramid_table(budget: float, n_max: int, num_layers: int, window: int, beta: float
                  ) -> np.ndarray:
    """[N + 1, L] `pyramid` for every prompt length n = 0..N, where N = min(n_max, 2B + w + 1).

    The schedule depends on n only while `2B - B/beta >= n - window` (the cap) or
    `n < max` (the fallback), i.e. for n <= 2B + window; longer prompts use row N. Index
    with `min(n, N)` under jit. Rows for n < budget are clamped to n (never used: such
    prompts are rejected by `validate`).
    """
    N = int(min(n_max, 2 * budget + window + 1))
    rows = [np.minimum(pyramid(budget, n, num_layers, window, beta), max(n, 0))
            for n in range(N + 1)]
    return np.stack(rows).astype(np.int32)


def flattened_heads(
    scores_BKn: Float[Array, "B K n"],
    per_head_B1: Int[Array, "B 1"],
    n_safe_B: Int[Array, "B"],
    max_per_head: int,
    max_safe: int,
    with_safe: bool = False,
    heads: Heads = Heads(),
):
    """AdaKV's flattened selection (kvpress `AdaKVPress.compress` semantics).

    With `b` the uniform per-head budget of the layer (traced, per batch element; at most
    `max_per_head`, static):
      1. safeguard: every head keeps its own top `n_safe` entries (kvpress:
         `int(b * alpha)`, at least 1 when alpha > 0; computed by the caller in Python
         float64 so the integers agree with kvpress; n_safe <= max_safe, static);
      2. one top-k over heads x positions keeps `K * b` entries in total.
    Forced entries (window, sinks) must already score +inf and padding -inf; kvpress gives
    its window `max + 1`, which is above every prefix score, so the two agree. Note that
    the safeguard is then spent on the window whenever `n_safe <= window` (as in kvpress).
    Returns the keep mask (per-head counts are its sums; they add up to `K * b`), and with
    `with_safe` also the safeguard mask (the top `n_safe` of every head). `heads`: the
    scores are one block of the heads (inside the engine's shard_map): the safeguard is
    per head, the top-k across every block (`kvjax.compression.heads.flat_top_mask`).
    """
    B, _, n = scores_BKn.shape
    K = heads.total(scores_BKn.shape[1])
    b = per_head_B1.reshape(B, 1)
    s = scores_BKn
    bump = jnp.zeros(s.shape, bool)
    if max_safe > 0:
        top = jax.lax.top_k(s, min(max_safe, n))[1]  # [B, K, max_safe]
        bump = mark(s.shape, top, jnp.arange(top.shape[-1]) < n_safe_B[:, None, None])
        s = jnp.where(bump, jnp.inf, s)
    total = K * b[:, 0]  # [B]
    k_max = min(K * max_per_head, K * n)
    keep = flat_top_mask(s, total, k_max, heads)  # lower flat index first on ties
    return (keep, bump) if with_safe else keep


def adakv_code_counts(
    scores_BKP: Float[Array, "B K P"], base: Int[Array, "B"], alpha: float,
    heads: Heads = Heads(),
) -> Int[Array, "B K"]:
    """The AdaKV authors' code variant (FFY0/AdaKV `AdaptiveSnapKVCluster`): counts of each
    head in a flattened top-`K * base` over the prefix scores (window apart), then mixed
    with a uniform floor: `round(count * (1 - alpha) + int(base * alpha))` per head. The
    counts then need not add up to `K * base` exactly (rounding). `base` excludes the
    window; prefix padding must score -inf. `heads`: one block of the heads (the engine's
    shard_map): the top-k runs across every block.
    """
    _, K, P = scores_BKP.shape
    Kg = heads.total(K)  # the top K * base over every head, ties lower flat index first
    chosen = flat_top_mask(scores_BKP, Kg * base, Kg * P, heads)
    count = jnp.sum(chosen, axis=-1).astype(jnp.float32)
    floor = jnp.floor(base.astype(jnp.float32) * alpha)[:, None]
    return jnp.round(count * (1 - alpha) + floor).astype(jnp.int32)
