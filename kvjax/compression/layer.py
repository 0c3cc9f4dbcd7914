"""What a method's hooks see of one layer and what they hand back (docs/design.md, "Hooks").

- `LayerIO`: one layer's queries, keys, values, positions and outputs, built by the
  engine's layer loops (prefill and cache extension) and passed to every layer hook.
  Its static fields carry the model config and the kernel implementations of the run,
  so a hook can size its output and call a kernel op without any global.
- `LayerKV`: the (k, v, pos, valid) a layer keeps; stacked over layers by the scan.
- `Rows`: a decode hook's sparse update of one layer's k or v.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
from jaxtyping import Array, Bool, Float, Int

from kvjax.compression.cache import LayerKV, set_rows
from kvjax.compression.heads import Heads
from kvjax.config import ModelConfig
from kvjax.pallas.dispatch import Kernels

__all__ = ["LayerIO", "LayerKV", "Revival", "Rows"]


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
    wo: Float[Array, "HDh D"] | None = None  # the layer's output projection W_O
    cfg: ModelConfig | None = None  # static: the model
    kernels: Kernels = Kernels()  # static: the run's kernel implementations
    # static: all KV heads, or this device's block of them inside the engine's shard_map;
    # what spans heads (a sum, a flattened top-k) goes through it (`kvjax.compression.heads`)
    heads: Heads = Heads()
    # prefill: each query's log-sum-exp over the prompt's keys (the causal softmax's
    # normaliser, +inf for a query that sees none), where the prompt attention computed it
    # (`attention.attend_blocked`, `attend_fused`); None elsewhere
    lse: Float[Array, "B K G T"] | None = None

    @property
    def kv(self) -> LayerKV:
        return LayerKV(self.k, self.v, self.pos, self.valid)

    @property
    def tiled(self) -> bool:
        """Whether a score over every query and key goes in tiles
        (`scoring.cumulative_attention`): where the prompt's attention is the CPU's tiled
        one; elsewhere (cuDNN, the chunked attention) in query bands."""
        return self.kernels.prompt_attention(self.q.dtype) == "blocked"

    def at_layer(self, a: Array) -> Array:
        """This layer's slice of a per-layer state array [L, ...]."""
        return jax.lax.dynamic_index_in_dim(a, self.layer, keepdims=False)

    def set_layer(self, a: Array, x: Array) -> Array:
        """A per-layer state array [L, ...] with this layer's slice replaced by x."""
        return jax.lax.dynamic_update_index_in_dim(a, x, self.layer, 0)

    @property
    def valid_BT(self) -> Bool[Array, "B T"]:
        """Prefill: which prompt columns are tokens (padding is False)."""
        return self.valid[:, 0]


jax.tree_util.register_dataclass(
    LayerIO,
    data_fields=["layer", "q", "k", "v", "pos", "valid", "qpos", "o", "hidden", "qvalid", "wo",
                 "lse"],
    meta_fields=["cfg", "kernels", "heads"])


class Revival(NamedTuple):
    """Cache rows a method asks the engine to recompute at one layer (`Method.revival`):
    their hidden states x [B, R, D] and cache slots [B, R] (-1: none); `active` (a traced
    bool) skips the work when nothing is revived. `mlp_first`: x stops after the previous
    layer's attention, so that layer's MLP runs first; `mlp_last`: this layer's MLP runs
    (False: x stops after this layer's attention). `keys` (static): the rows attend to the
    first `keys` slots of the layer only (where the method knows all they may see lies)."""

    x: Array
    slot: Array
    active: Array
    mlp_first: Array | bool = False
    mlp_last: Array | bool = True
    keys: int | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rows:
    """A decode hook's sparse update of one layer's k or v: rows `idx` [B, K, E] (C drops
    the row) set to `new` [B, K, E, Dh]. The engine scatters it into the cache in place;
    a whole new [B, K, C, Dh] layer would cost a copy of the layer and its write-back."""

    idx: Int[Array, "B K E"]
    new: Float[Array, "B K E Dh"]

    def into(self, x: Float[Array, "B K C Dh"]) -> Float[Array, "B K C Dh"]:
        """x with the rows set (the dense equivalent of what the engine writes)."""
        return set_rows(x, (), self.idx, self.new)
