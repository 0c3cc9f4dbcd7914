"""The KV cache: a fixed-shape pytree with masked budgets (ARCHITECTURE.md section 3).

Every array has a static shape, so one compiled program serves every budget: a layer or
head that keeps fewer entries has fewer `valid` slots, not a smaller array. Keys are
stored with RoPE already applied at their original position, and `pos` remembers that
position: compaction never renumbers positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: Float[Array, "L B K C D"]
    v: Float[Array, "L B K C D"]
    pos: Int[Array, "L B K C"]  # original token position of each slot
    valid: Bool[Array, "L B K C"]  # live slots: the masked budget
    end: Int[Array, ""]  # next free slot, shared by all layers, batch elements and heads
    next_pos: Int[Array, "B"]  # original position the next token of each element gets

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]


def init(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache: no live slot, positions start at 0."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity)
    return KVCache(
        k=jnp.zeros((*shape, cfg.head_dim), dtype),
        v=jnp.zeros((*shape, cfg.head_dim), dtype),
        pos=jnp.zeros(shape, jnp.int32),
        valid=jnp.zeros(shape, bool),
        end=jnp.zeros((), jnp.int32),
        next_pos=jnp.zeros((batch,), jnp.int32),
    )


def write(
    kv: tuple[Array, Array, Array, Array],
    layer: Int[Array, ""],
    k_BKTD: Float[Array, "B K T D"],
    v_BKTD: Float[Array, "B K T D"],
    pos_BT: Int[Array, "B T"],
    valid_BT: Bool[Array, "B T"],
    slot_BKT: Int[Array, "B K T"],
):
    """Scatter T new entries of one layer into the given slots of (k, v, pos, valid) [L,B,K,C,..].

    Only the written rows move (an in-place scatter inside the decode loop), not the layer.
    """
    k_all, v_all, pos_all, valid_all = kv
    lead = (layer,)
    return (
        set_rows(k_all, lead, slot_BKT, k_BKTD),
        set_rows(v_all, lead, slot_BKT, v_BKTD),
        set_rows(pos_all, lead, slot_BKT, jnp.broadcast_to(pos_BT[:, None, :], slot_BKT.shape)),
        set_rows(valid_all, lead, slot_BKT,
                 jnp.broadcast_to(valid_BT[:, None, :], slot_BKT.shape)),
    )


def set_rows(x: Array, lead: tuple, slot_BKE: Int[Array, "B K E"], new: Array) -> Array:
    """x [*lead, B, K, C, ...] with slots slot_BKE of x[lead] set to new [B, K, E, ...]; a
    slot >= C drops its row."""
    B, K, _ = slot_BKE.shape
    idx = (*lead, jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], slot_BKE)
    return x.at[idx].set(new.astype(x.dtype), mode="drop")


def append(cache: KVCache, k_LBKD: Array, v_LBKD: Array, valid_B: Bool[Array, "B"] | None = None
           ) -> KVCache:
    """Write one decoded token of every layer at slot `end`, position `next_pos`."""
    L, B, K = k_LBKD.shape[:3]
    valid_B = jnp.ones((B,), bool) if valid_B is None else valid_B
    idx = (slice(None), slice(None), slice(None), cache.end)
    pos = jnp.broadcast_to(cache.next_pos[None, :, None], (L, B, K))
    return dataclasses.replace(
        cache,
        k=cache.k.at[idx].set(k_LBKD.astype(cache.k.dtype)),
        v=cache.v.at[idx].set(v_LBKD.astype(cache.v.dtype)),
        pos=cache.pos.at[idx].set(pos),
        valid=cache.valid.at[idx].set(jnp.broadcast_to(valid_B[None, :, None], (L, B, K))),
        end=cache.end + 1,
        next_pos=cache.next_pos + valid_B.astype(jnp.int32),
    )


def keep(cache: KVCache, keep_LBKC: Bool[Array, "L B K C"], capacity: int) -> KVCache:
    """Keep the live slots marked in `keep` and compact them to the front, in slot order.

    Each (layer, element, head) may keep a different number; the rest of the `capacity`
    slots are dead. Raises nothing under jit: keeping more than `capacity` drops the last
    ones, so callers size `capacity` to their largest count.
    """
    keep_LBKC = keep_LBKC & cache.valid
    order = jnp.argsort(~keep_LBKC, axis=-1, stable=True)[..., :capacity]
    take = lambda x: jnp.take_along_axis(x, order[..., None] if x.ndim == 5 else order, axis=3)
    count = jnp.sum(keep_LBKC, axis=-1, keepdims=True)
    return dataclasses.replace(
        cache, k=take(cache.k), v=take(cache.v), pos=take(cache.pos),
        valid=jnp.arange(order.shape[-1]) < count,
        end=jnp.minimum(jnp.max(count), capacity).astype(jnp.int32),
    )


def gather(
    x_BKC: Array, idx_BKS: Int[Array, "B K S"]
) -> Array:
    """Rows of a per-(batch, head) slot axis at the given indices (axis 2)."""
    if x_BKC.ndim == 4:
        return jnp.take_along_axis(x_BKC, idx_BKS[..., None], axis=2)
    return jnp.take_along_axis(x_BKC, idx_BKS, axis=2)


def pad_capacity(cache: KVCache, capacity: int) -> KVCache:
    """Grow the slot axis to `capacity` with dead slots (decoding headroom)."""
    extra = capacity - cache.capacity
    if extra < 0:
        raise ValueError(f"capacity {capacity} is smaller than the cache's {cache.capacity}")
    if extra == 0:
        return cache
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, extra)] + [(0, 0)] * (x.ndim - 4))
    return dataclasses.replace(
        cache, k=pad(cache.k), v=pad(cache.v), pos=pad(cache.pos), valid=pad(cache.valid)
    )


def live_extent(cache: KVCache) -> Int[Array, ""]:
    """1 + the last slot live in any (layer, element, head); 0 for an empty cache."""
    slot_C = jnp.arange(1, cache.capacity + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(cache.valid, slot_C, 0))


def shrink(cache: KVCache, slots: int, capacity: int) -> KVCache:
    """Keep the first `slots` slots (every live one must be among them: `live_extent`),
    append from there, and pad to `capacity` for what comes next."""
    cut = lambda x: x[:, :, :, :slots]  # noqa: E731
    cache = dataclasses.replace(cache, k=cut(cache.k), v=cut(cache.v), pos=cut(cache.pos),
                                valid=cut(cache.valid), end=jnp.asarray(slots, jnp.int32))
    return pad_capacity(cache, capacity)


def kv_bytes(cache: KVCache) -> dict[str, int]:
    """Live bytes (what a paged allocator would hold) and allocated bytes (this layout)."""
    per_slot = 2 * cache.k.shape[-1] * cache.k.dtype.itemsize
    live = int(np.count_nonzero(np.asarray(cache.valid))) * per_slot
    allocated = int(cache.valid.size) * per_slot
    return {"kv_bytes_live": live, "kv_bytes_allocated": allocated}


def full_kv_bytes(cfg: ModelConfig, tokens: int, dtype=jnp.float32) -> int:
    """Bytes an uncompressed cache holds for `tokens` tokens of one sequence."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * tokens * itemsize
