"""The KV cache: a fixed-shape pytree with masked budgets (docs/design.md, "The cache").

Every array has a static shape, so one compiled program serves every budget: a layer or
head that keeps fewer entries has fewer `valid` slots, not a smaller array. Keys are
stored with RoPE already applied at their original position, and `pos` remembers that
position: compaction never renumbers positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax.config import ModelConfig
from kvjax.pallas.ops.compact.xla import take_slots  # noqa: F401 -- the gather, owned by the op


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
    """The entries of one layer, or of every layer with a leading L axis (the layer scan
    stacks what each layer keeps). In a decode hook's result `k` and `v` may be
    `kvjax.compression.layer.Rows`: only those rows change."""

    k: Any  # Float[Array, "(L) B K S Dh"] | Rows
    v: Any
    pos: Int[Array, "(L) B K S"]  # original token positions
    valid: Bool[Array, "(L) B K S"]  # live slots

    def __iter__(self):
        """`k, v, pos, valid = kv` (by name everywhere else)."""
        return iter((self.k, self.v, self.pos, self.valid))


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

    @property
    def kv(self) -> LayerKV:
        """k, v, pos and valid of every layer [L, ...]."""
        return LayerKV(self.k, self.v, self.pos, self.valid)

    @classmethod
    def of(cls, kv: LayerKV, end, next_pos) -> "KVCache":
        return cls(kv.k, kv.v, kv.pos, kv.valid, end=end, next_pos=next_pos)



def write(
    kv: LayerKV,
    layer: Int[Array, ""] | None,
    k_BKTD: Float[Array, "B K T D"],
    v_BKTD: Float[Array, "B K T D"],
    pos_BT: Int[Array, "B T"],
    valid_BT: Bool[Array, "B T"],
    slot_BKT: Int[Array, "B K T"] | Int[Array, ""],
):
    """T new entries of one layer written into the given slots of kv [L, B, K, C, ...]
    (`layer` None: kv is that layer's own [B, K, C, ...]).

    Only the written rows move (in place inside the decode loop), not the layer. `slot_BKT`
    [B, K, T] is a scatter whose slots >= C drop their row; a scalar is the first of T
    consecutive slots shared by every element and head (an append at the cache's `end`),
    written as one `dynamic_update_slice`: a scatter of one row cost 148 us a layer on an
    H100 (docs/results/gpu_targets.md). The caller keeps start + T <= C (the capacity has
    room for every appended token: `Method.decode_capacity`).
    """
    lead = () if layer is None else (layer,)
    B, K = k_BKTD.shape[:2]
    T = pos_BT.shape[1]
    pos_BKT, valid_BKT = (jnp.broadcast_to(a[:, None, :], (B, K, T)) for a in (pos_BT, valid_BT))
    new = (k_BKTD, v_BKTD, pos_BKT, valid_BKT)
    if jnp.ndim(slot_BKT) == 0:
        return LayerKV(*(_put(a, lead, slot_BKT, n) for a, n in zip(kv, new)))
    return LayerKV(*(set_rows(a, lead, slot_BKT, n) for a, n in zip(kv, new)))


def _put(x: Array, lead: tuple, start: Int[Array, ""], new: Array) -> Array:
    """x [*lead, B, K, C, ...] with slots [start, start + E) of x[lead] set to new
    [B, K, E, ...]."""
    new = new.astype(x.dtype)[(None,) * len(lead)]
    zero = jnp.zeros((), jnp.int32)
    at = (*lead, zero, zero, jnp.asarray(start, jnp.int32), *(zero,) * (new.ndim - len(lead) - 3))
    return jax.lax.dynamic_update_slice(x, new, at)


def set_rows(x: Array, lead: tuple, slot_BKE: Int[Array, "B K E"], new: Array) -> Array:
    """x [*lead, B, K, C, ...] with slots slot_BKE of x[lead] set to new [B, K, E, ...]; a
    slot >= C drops its row."""
    B, K, _ = slot_BKE.shape
    idx = (*lead, jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], slot_BKE)
    return x.at[idx].set(new.astype(x.dtype), mode="drop")




def split_layers(kv: LayerKV) -> tuple[LayerKV, ...]:
    """Each layer's entries as its own buffers (decode over per-layer buffers)."""
    return tuple(LayerKV(*(a[i] for a in kv)) for i in range(kv.k.shape[0]))


def stack_layers(kvs: tuple[LayerKV, ...]) -> LayerKV:
    """`split_layers` undone: every layer's entries with a leading L axis."""
    return LayerKV(*(jnp.stack(a) for a in zip(*kvs)))


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
    valid = cache.valid
    if isinstance(valid, jax.Array) and not valid.is_fully_addressable:
        n = int(jnp.count_nonzero(valid))  # multi-process: counted where the mask lives
    else:
        n = int(np.count_nonzero(np.asarray(valid)))  # no program compiled for it
    live = n * per_slot
    allocated = int(cache.valid.size) * per_slot
    return {"kv_bytes_live": live, "kv_bytes_allocated": allocated}


def full_kv_bytes(cfg: ModelConfig, tokens: int, dtype=jnp.float32) -> int:
    """Bytes an uncompressed cache holds for `tokens` tokens of one sequence."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * tokens * itemsize
