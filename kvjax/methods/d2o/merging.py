"""D2O's merging (D2O paper Eq. 9-12): each evicted key's nearest kept key by cosine
similarity (`nearest`; `nearest_blocked` for the authors' code's first-step bulk eviction),
and the weighted merge of the evicted entries into it (`merge`: the paper's softmax weights,
Eq. 11-12, or the code's similarity-weighted `scatter_reduce(mean, include_self)`,
modeling_llama3_7b_13b_d2o.py:401-404 in AIoT-MLSys-Lab/d2o)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.compression.layer import Rows

MERGES = ("softmax", "mean")


def cosine(a, b, eps: float = 1e-6):
    """[..., I, D] x [..., J, D] -> [..., I, J] cosine similarities (fp32)."""
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    a = a / jnp.maximum(jnp.linalg.norm(a, axis=-1, keepdims=True), eps)
    b = b / jnp.maximum(jnp.linalg.norm(b, axis=-1, keepdims=True), eps)
    return jnp.einsum("...id,...jd->...ij", a, b)


def nearest(k, kept, ks):
    """Each source key's most similar kept entry of the same head.

    k [..., C, D]; kept [..., C]; ks [..., E, D] the source keys. Returns (j [..., E]: the
    kept slot of the largest cosine, the lowest slot on ties; maxsim [..., E]: that cosine,
    -inf where the head keeps nothing)."""
    u = jnp.where(kept[..., None, :], cosine(ks, k), -jnp.inf)  # [..., E, C]
    return jnp.argmax(u, axis=-1), jnp.max(u, axis=-1)


def nearest_blocked(k, kept, block: int):
    """`nearest(k, kept, k)`: every slot as a source against the `kept` slots of its head,
    `block` sources at a time (`lax.map`), so the similarities held at once are
    [..., block, C], never [..., C, C]. k [B, K, C, D]; returns (j, maxsim) [B, K, C]."""
    B, K, C, D = k.shape
    blk = max(1, min(block, C))
    nb = -(-C // blk)
    kn = k.astype(jnp.float32)
    kn = kn / jnp.maximum(jnp.linalg.norm(kn, axis=-1, keepdims=True), 1e-6)
    src = jnp.pad(kn, [(0, 0), (0, 0), (0, nb * blk - C), (0, 0)])
    src = jnp.moveaxis(src.reshape(B, K, nb, blk, D), 2, 0)  # [nb, B, K, blk, D]

    def one(x):
        u = jnp.where(kept[..., None, :], jnp.einsum("bkid,bkjd->bkij", x, kn), -jnp.inf)
        return jnp.argmax(u, axis=-1), jnp.max(u, axis=-1)

    j, u = jax.lax.map(one, src)  # [nb, B, K, blk]
    return tuple(jnp.moveaxis(x, 0, 2).reshape(B, K, nb * blk)[..., :C] for x in (j, u))


def _into_slots(x, j, C: int):
    """Sum x [..., E, *F] into C slots by j [..., E]: [..., C, *F] (a scatter-add, O(E F))."""
    lead, E, feat = j.shape[:-1], j.shape[-1], x.shape[j.ndim:]
    out = jax.vmap(lambda jj, xx: jnp.zeros((C, *feat), xx.dtype).at[jj].add(xx))(
        j.reshape(-1, E), x.reshape(-1, E, *feat))
    return out.reshape(*lead, C, *feat)


def merge(k, v, kept, ks, vs, gone, tau, kind: str, enabled: bool = True, near=None,
          rows: bool = False, ok=None):
    """Merge the evicted sources into their nearest `kept` entry of the same head.

    k, v [..., C, D] and kept [..., C]: the targets; ks, vs [..., E, D]: the sources, `gone`
    [..., E] those of them evicted (the prefill passes every prompt entry against the kept
    slots, a decode step its <= T evicted ones, so the cost is O(E C D), never O(n^2 D));
    tau [...] (the threshold, broadcast per head); `near`: `nearest(k, kept, ks)` when the
    caller has it. Returns (k, v, merged [..., E] (which sources merged), maxsim [..., E]).
    Source i has u_i = cos(k_i, k_j) over the kept j; it merges into j* = argmax_j u_ij
    when max_j u_ij >= tau. Eq. 11-12 (softmax: weights exp(u_ij*) against e for the kept
    entry) or the code's mean (weights u_ij* against 1, divided by 1 + the count).
    `rows=True` (a decode step's few sources, k and v [B, K, C, D]) returns k and v as `Rows`
    (the target rows only, O(E^2 D), which `extend` scatters into the cache); the default
    scatters into all C slots and rewrites the layer, O(C D). `ok` [..., E]: which sources
    merge, when the caller decided it (D2O's per-layer threshold decides on the mean over
    heads); `tau` is then unused.
    """
    C = k.shape[-2]
    j, maxsim = nearest(k, kept, ks) if near is None else near
    if ok is None:
        ok = maxsim >= tau[..., None]
    ok = gone & ok & jnp.any(kept, axis=-1, keepdims=True)
    if not enabled:
        return k, v, jnp.zeros_like(ok), maxsim
    softmax = kind == "softmax"
    self_w = math.e if softmax else 1.0
    w = jnp.where(ok, jnp.exp(maxsim) if softmax else maxsim, 0.0)  # [..., E]
    if rows:  # source s joins target row t's sum when it merges into the same slot
        same = (j[..., :, None] == j[..., None, :]) & ok[..., None, :]  # [..., E, E]
        den = self_w + jnp.sum(jnp.where(same, w[..., None, :] if softmax else 1.0, 0.0), -1)

        def apply(x, xs):
            tgt = jnp.take_along_axis(x, j[..., None], axis=-2).astype(jnp.float32)
            add = jnp.einsum("...ts,...sd->...td", jnp.where(same, w[..., None, :], 0.0),
                             xs.astype(jnp.float32))
            new = (self_w * tgt + add) / den[..., None]
            return Rows(jnp.where(ok, j, C), new.astype(x.dtype))
    else:
        count = _into_slots(ok.astype(jnp.float32), j, C)  # [..., C]
        den = self_w + (_into_slots(w, j, C) if softmax else count)

        def apply(x, xs):
            xf = x.astype(jnp.float32)
            new = (self_w * xf + _into_slots(w[..., None] * xs.astype(jnp.float32), j, C)
                   ) / den[..., None]
            return jnp.where((count > 0)[..., None], new, xf).astype(x.dtype)

    return apply(k, ks), apply(v, vs), ok, maxsim
