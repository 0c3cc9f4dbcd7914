"""The method protocol: a frozen dataclass of hyperparameters with a few pure hooks.

A method is hashable, so it is a static argument of `jit`; the engine calls its hooks
(ARCHITECTURE.md section 4) and a hook it does not override does nothing. The base class
is itself the uncompressed baseline `full`.

hooks (engine call sites):
  validate(n, cfg)              before tracing: reject budgets the prompt cannot satisfy
  prefill(params, cfg, ...)     the whole prefill; the default scans all layers on the full
                                prompt and calls the next three hooks. Methods that change
                                the token set between layers (ASL, FastKV, GemFilter,
                                SlimInfer) override it
  kept_slots(n)                 static slots per (layer, head) after prefill
  cache_slots(n, cfg)           the same on a given model (default kept_slots(n)); for
                                methods whose slot count depends on it (AdaKV: heads)
  init_state(cfg, batch, n)     method state pytree carried through the prefill scan
  after_layer_prefill(io, st)   inside the layer scan: what this layer keeps (-> LayerKV)
  finalize(kv, st)              after the scan: cross-layer allocation (LAVa, D2O, ...);
                                returns (kv, decode state, stats)
  next_position(kv, pos, valid)  [B] position of the first token after the prompt
  decode_capacity(kept, q, new) static cache slots while decoding (default: append-only,
                                kept + question + max_new; methods that evict while
                                decoding keep a fixed budget and need far fewer)
  pad_state(st, capacity)       the decode state once the cache has `capacity` slots
                                (per-slot state such as H2O's accumulated scores)
  decode_slots(cache, st, T)    slots [L, B, K, T] the next T tokens are written to
                                (None: append at `end`)
  decode_layer                  None, or a DecodeHook called after each layer's attention
                                while decoding (H2O cumulative scores, D2O merges, ...);
                                k and v it returns as `Rows` are scattered in place
  decode_driver()               None (the engine's compiled decode loop), or a callable
                                that owns decoding: a host loop over compiled steps, for
                                methods that move KV between host and device between
                                steps (SlimInfer). Called as driver(params, cfg, cache,
                                logits, rng, state, max_new=, sampling=, stop_ids=,
                                sample=) -> (tokens [B, max_new], counts [B], cache, state,
                                stats incl. `compile_s` and `decode_s`)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.models import transformer
from kvjax.models.transformer import LayerIO

# (k [B,K,S,Dh], v [B,K,S,Dh], pos [B,K,S], valid [B,K,S]) for one layer
LayerKV = tuple


@dataclasses.dataclass(frozen=True)
class Method:
    """`full`: the uncompressed cache, every prompt entry kept (the baseline of every table)."""

    name: ClassVar[str] = "full"
    decode_layer: ClassVar[Any] = None
    # chooses by position alone (no attention scores), so it is sound under a sliding window
    positional: ClassVar[bool] = True

    def validate(self, n: int, cfg: ModelConfig) -> None:
        """Raise ValueError naming the bad value when this method cannot run on n tokens."""

    def with_budget(self, budget: int) -> "Method":
        """This method at a KV budget of `budget` entries per (layer, KV head) (`--budget`);
        a method without a budget (`full`) is returned unchanged."""
        if "budget" in {f.name for f in dataclasses.fields(self)}:
            return dataclasses.replace(self, budget=budget)
        return self

    def kept_slots(self, n: int) -> int:
        return n

    def cache_slots(self, n: int, cfg: ModelConfig) -> int:
        return self.kept_slots(n)

    def prefill(self, params, cfg: ModelConfig, tokens_BT, valid_BT, pos_BT):
        """-> (hidden state of the last prompt token [B, D], (k, v, pos, valid) stacked over
        layers with `kept_slots(T)` slots, decode state, stats)."""
        state = self.init_state(cfg, *tokens_BT.shape)
        x, kv, state = transformer.prefill(params, cfg, tokens_BT, valid_BT, pos_BT,
                                           self.after_layer_prefill, state)
        kv, state, stats = self.finalize(kv, state)
        return x[:, -1], kv, state, stats

    def init_state(self, cfg: ModelConfig, batch: int, n: int) -> Any:
        return None

    def after_layer_prefill(self, io: LayerIO, state: Any) -> tuple[LayerKV, Any]:
        return (io.k, io.v, io.pos, io.valid), state

    def finalize(self, kv: LayerKV, state: Any) -> tuple[LayerKV, Any, dict]:
        return kv, state, {}

    def next_position(self, kv: LayerKV, pos_BT, valid_BT):
        """[B] the position the first token after the prompt gets: the largest kept
        position + 1 (the last prompt token is kept; GemFilter-style second passes
        renumber positions). Methods that may evict the last token override it."""
        return jnp.max(jnp.where(kv[3], kv[2], -1), axis=(0, 2, 3)) + 1

    def decode_capacity(self, kept: int, question: int, max_new: int) -> int:
        """Slots per (layer, head) of the decoding cache: the prefill's `kept` slots plus
        room for a `question` chunk (context-only scenario) and `max_new` tokens."""
        return kept + question + max_new

    def pad_state(self, state: Any, capacity: int) -> Any:
        return state

    def decode_slots(self, cache, state, T: int):
        return None

    def decode_driver(self):
        return None

    def static_after_prefill(self) -> bool:
        """True when decoding only appends (no decode-time hooks, state or slots): then
        the dead slots the prefill left may be dropped before decoding (`engine.run`)."""
        cls = type(self)
        return (self.decode_layer is None and self.decode_driver() is None
                and cls.decode_slots is Method.decode_slots and cls.pad_state is Method.pad_state
                and cls.decode_capacity is Method.decode_capacity)
