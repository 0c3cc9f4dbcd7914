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
  init_state(cfg, batch, n)     method state pytree carried through the prefill scan
  after_layer_prefill(io, st)   inside the layer scan: what this layer keeps (-> LayerKV)
  finalize(kv, st)              after the scan: cross-layer allocation (LAVa, D2O, ...);
                                returns (kv, decode state, stats)
  decode_slots(cache, st, T)    slots [L, B, K, T] the next T tokens are written to
                                (None: append at `end`)
  decode_layer                  None, or a DecodeHook called after each layer's attention
                                while decoding (H2O cumulative scores, D2O merges, ...)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

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

    def decode_slots(self, cache, state, T: int):
        return None
