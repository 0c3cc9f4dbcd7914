"""The method protocol: a frozen dataclass of hyperparameters and the hooks the engine calls.

A method is hashable, so it is a static argument of `jit`. It never runs the model: the
engine (`kvjax.engine`) owns prefill, compression and decoding, and calls the hooks below
at fixed points (docs/design.md, "Hooks"). Every hook is a method of this class with a
documented default that does nothing; the base class is itself the uncompressed baseline
`full`.

Prefill. `prefill_kind` picks one of the engine's prefill loops:
  "scan"             every layer on the whole prompt (`kvjax.engine.layers`); after each
                     layer's attention `after_layer_prefill` decides what the layer keeps,
                     and `finalize` allocates across layers at the end;
  "token_selection"  tokens are selected once at some layer and deeper layers run on them
                     (ASL, FastKV, GemFilter): the `protocols.TokenSelection` hooks;
  "block_pruning"    blocks of hidden states are pruned at fixed stages (SlimInfer,
                     LazyLLM): the `protocols.BlockPruning` hooks.
A method of those kinds that lacks a hook of its protocol is refused when it is made.

Decoding. The engine writes each new token into `decode_slots` (default: append), runs
every layer, and calls `decode_layer` after each layer's attention when
`uses_decode_layer()`. A method that moves KV between host and device between steps
(SlimInfer's offload) says so with `steps_on_host()`: the engine then runs its host loop
of compiled steps and calls `between_steps` before each one.

Statistics. `finalize` and `decode_stats` return the method's own statistics: one
mapping, merged beside the engine's (`kv_bytes_*`, `ttft_s`, ...).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar

import jax.numpy as jnp

from kvjax.compression.cache import KVCache, LayerKV
from kvjax.compression import protocols
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig

PREFILL_KINDS = ("scan", "token_selection", "block_pruning")


def check_budget(method) -> None:
    """Raise ValueError naming the bad value unless `method.budget` (where it has one) is a
    positive integer, a positive float where the method keeps one (`float_budget`), or None
    where None is the field's default (the budget then comes from another parameter)."""
    fields = {f.name: f for f in dataclasses.fields(method)}
    if "budget" not in fields:
        return
    b = method.budget
    if b is None and fields["budget"].default is None:
        return
    kinds = (numbers.Real,) if method.float_budget else (numbers.Integral,)
    # a float mean may lie below 1 (kvpress's n (1 - r) on a short prompt); a count may not
    if isinstance(b, bool) or not isinstance(b, kinds) or not (
            b > 0 if method.float_budget else b >= 1):
        want = "a number > 0" if method.float_budget else "an integer >= 1"
        raise ValueError(f"{method.name}: budget={b!r}: expected {want} (KV entries kept per "
                         "layer and KV head)")


@dataclasses.dataclass(frozen=True)
class Method:
    """`full`: the uncompressed cache, every prompt entry kept (the baseline of every table)."""

    name: ClassVar[str] = "full"
    prefill_kind: ClassVar[str] = "scan"
    # chooses by position alone (no attention scores), so it is sound under a sliding window
    positional: ClassVar[bool] = True
    # a budget may be a float (PyramidKV keeps kvpress's float n (1 - r) as its average)
    float_budget: ClassVar[bool] = False

    def __post_init__(self):
        check_budget(self)
        protocols.check_interface(self)

    # ---- before tracing ---------------------------------------------------------------

    def validate(self, n: int, cfg: ModelConfig) -> None:
        """Raise ValueError naming the bad value when this method cannot run on n tokens."""

    def with_budget(self, budget: int) -> "Method":
        """This method at a KV budget of `budget` entries per (layer, KV head) (`--budget`);
        a method without a budget (`full`) is returned unchanged."""
        if "budget" in {f.name for f in dataclasses.fields(self)}:
            return dataclasses.replace(self, budget=budget)
        return self

    def takes_budget(self) -> bool:
        """Whether `with_budget` changes this method (`--budget` sweeps it; `full` has none)."""
        return "budget" in {f.name for f in dataclasses.fields(self)}

    def budget_for(self, n: int) -> int | float | None:
        """The budget this method keeps per (layer, KV head) on an n-token compressed prompt,
        as a record reports it; None where it has none."""
        return getattr(self, "budget", None)

    def with_ratio(self, ratio: float, n: int) -> "Method":
        """This method at kvpress's compression ratio (`--ratio`) on an n-token compressed
        prompt: the fraction `ratio` of it removed, so `int(n (1 - ratio))` kept (at least
        1: kvpress `compute_n_kept`). `n` is what the method compresses -- the whole prompt
        question-aware, the context alone context-only -- so a ratio means the same in both
        scenarios. A wrapper (`kvjax.compression.wrapper`) passes it to its base; a method
        whose arithmetic keeps the float (PyramidKV's schedule) overrides this."""
        if not 0 <= ratio < 1:
            raise ValueError(f"ratio={ratio} must be in [0, 1) (the fraction removed)")
        return self.with_budget(max(1, int(n * (1 - ratio))))

    def for_prompt(self, n: int) -> "Method":
        """This method with its length-dependent defaults resolved for a batch whose longest
        prompt has n tokens (ASL's `select_k` as a fraction of the prompt, FastKV's rates):
        static values (shapes) are one per batch. The engine calls it first."""
        return self

    def kept_slots(self, n: int) -> int:
        """Static slots per (layer, KV head) after the prefill of an n-token (padded) prompt."""
        return n

    def cache_slots(self, n: int, cfg: ModelConfig) -> int:
        """`kept_slots` on a given model (for methods whose count depends on it: AdaKV's
        heads, HeadKV's budget table)."""
        return self.kept_slots(n)

    # ---- prefill ("scan") --------------------------------------------------------------

    def init_state(self, cfg: ModelConfig, batch: int, n: int) -> Any:
        """The state carried through the prefill's layer scan."""
        return None

    def after_layer_prefill(self, io: LayerIO, state: Any) -> tuple[LayerKV, Any, Any]:
        """Inside the layer scan: (what this layer keeps, per-layer outputs for `finalize`
        (stacked over layers; None for nothing), state)."""
        return io.kv, None, state

    def finalize(self, kv: LayerKV, aux: Any, state: Any) -> tuple[LayerKV, Any, dict]:
        """After the scan (kv and aux stacked over layers): (the cache's kv, the decode
        state, the method's statistics). Cross-layer allocation happens here (LAVa, D2O)."""
        return kv, state, {}

    def splits_heads(self) -> bool:
        """True when `after_layer_prefill` gives the single-device result on a block of the
        KV heads: its work is per head and whatever spans heads goes through `io.heads`
        (`kvjax.compression.heads`). On a mesh with a `model` axis the engine then runs the
        hook per device in a shard_map (`kvjax.distributed.shard_heads`); otherwise XLA
        partitions it from the placements. A subclass that adds work across heads without
        `io.heads` returns False again."""
        return False

    def next_position(self, kv: LayerKV, pos_BT, valid_BT):
        """[B] the position the first token after the prompt gets: the largest kept
        position + 1 (the last prompt token is kept; GemFilter-style second passes
        renumber positions). Methods that may evict the last token override it."""
        return jnp.max(jnp.where(kv.valid, kv.pos, -1), axis=(0, 2, 3)) + 1

    # ---- decoding -----------------------------------------------------------------------

    def decode_capacity(self, kept: int, question: int, max_new: int) -> int:
        """Slots per (layer, head) of the decoding cache: the prefill's `kept` slots plus
        room for a `question` chunk (context-only scenario) and `max_new` tokens."""
        return kept + question + max_new

    def pad_state(self, state: Any, capacity: int) -> Any:
        """The decode state once the cache has `capacity` slots (per-slot state such as
        H2O's accumulated scores)."""
        return state

    def decode_slots(self, cache: KVCache, state: Any, T: int):
        """Slots [L, B, K, T] the next T tokens are written to; None appends at `end`.
        Each layer's slots depend on that layer's `valid` alone: over per-layer buffers
        (`layered_hooks`) it is called once a layer on a one-layer view (L = 1)."""
        return None

    def decode_layer(self, io: LayerIO, probs, state: Any) -> tuple[LayerKV, Any]:
        """After each layer's attention while the cache is extended (decoding, or a
        question chunk): `probs` [B, K, G, T, C]. Returns the layer's kv (k and v may be
        `Rows`, scattered in place) and the state. Called only when `uses_decode_layer()`."""
        return io.kv, state

    def revival(self, layer, state: Any):
        """Before a layer's attention while the cache is extended: rows of the cache to
        recompute at this layer (`kvjax.compression.layer.Revival`), or None (the default:
        nothing). The engine writes their keys and values at this layer, runs the layer on
        them over the layer's cache (causally), and hands the new x to `revived`. SlimInfer
        revives blocks pruned at prefill from their stored hidden states this way."""
        return None

    def revived(self, layer, x_BRD, state: Any) -> Any:
        """The state once the rows of `revival` went through the layer (x after it)."""
        return state

    def after_step(self, cfg: ModelConfig, cache: KVCache, state: Any) -> Any:
        """After every layer saw the new tokens (compiled, once per extension)."""
        return state

    def after_layers(self, cfg: ModelConfig, cache: KVCache, state: Any, upto: int) -> Any:
        """After layers [.., upto) saw the new tokens (compiled): at every boundary of a
        split step (`decode_segments`), and with upto = L at the end of every extension,
        where the default is `after_step`."""
        return self.after_step(cfg, cache, state) if upto == cfg.num_layers else state

    def uses_decode_layer(self) -> bool:
        """Whether the engine must call `decode_layer` (and compute attention probabilities
        for it): by default, when a subclass overrides it."""
        return type(self).decode_layer is not Method.decode_layer

    def extension_phases(self) -> "tuple[Method, Method] | None":
        """(first, later): the method the engine runs for the cache's first extension (the
        context-only question, else the first decoding step) and for every later one, each
        compiled on its own; None: every extension alike. For a method whose first step
        differs in shape (D2O's code: a bulk eviction rewriting the layer) this keeps the
        first step's work out of the others, where a `lax.cond` would carry its shapes."""
        return None

    def steps_on_host(self) -> bool:
        """True: decode is a host loop of compiled steps with `between_steps` before each
        (host <-> device copies cannot happen inside a `lax.while_loop`)."""
        return False

    def decode_segments(self, cfg: ModelConfig) -> tuple[int, ...]:
        """Layer indices where a host-loop decode step is split (`steps_on_host` methods):
        the engine runs layers [0, b1), then `between_segments`, then [b1, b2), ... One
        compiled call per part; () keeps each step one call."""
        return ()

    def between_segments(self, host: Any, i: int, cache: KVCache, state: Any, done
                         ) -> tuple[KVCache, Any]:
        """Host-side, after part i of a split decode step (`decode_segments`)."""
        return cache, state

    def between_steps(self, host: Any, cache: KVCache, state: Any, done) -> tuple[KVCache, Any]:
        """Host-side, before each step of a `steps_on_host` method: may move KV between
        host and device. `host` is the bookkeeping `init_host` returned."""
        return cache, state

    def init_host(self, cfg: ModelConfig, cache: KVCache, state: Any, compile
                  ) -> tuple[Any, Any, float]:
        """Before a `steps_on_host` decode: (host bookkeeping, the decode state, seconds
        spent compiling the hook's own programs, reported apart from the run's time).
        `compile(fn, args, **static)` is the engine's ahead-of-time compiler."""
        return None, state, 0.0

    def decode_stats(self, host: Any, state: Any) -> dict:
        """The method's statistics of the decoding phase (merged into its prefill stats)."""
        return {}

    def static_after_prefill(self) -> bool:
        """True when decoding only appends (no decode-time hooks, state or slots): then
        the dead slots the prefill left may be dropped before decoding."""
        cls = type(self)
        return (not self.uses_decode_layer() and not self.steps_on_host()
                and cls.decode_slots is Method.decode_slots and cls.pad_state is Method.pad_state
                and cls.decode_capacity is Method.decode_capacity)

    def plain_decode(self) -> bool:
        """True when a decode step is the plain model's, appending at the cache's end:
        `static_after_prefill` and no hook runs inside or after a step (`revival`,
        `after_step`, `after_layers`, `extension_phases`). The engine may then run the
        step over per-layer buffers (`Kernels.decode_layers`), where no hook can reach
        the stacked cache."""
        cls = type(self)
        return (self.static_after_prefill() and self.extension_phases() is None
                and all(getattr(cls, h) is getattr(Method, h)
                        for h in ("revival", "revived", "after_step", "after_layers")))

    def layered_hooks(self) -> bool:
        """True when a decode step with this method's hooks may also run over per-layer
        buffers (`Kernels.decode_layers`): its hooks read one layer's cache at a time
        (`decode_layer`; `decode_slots` reads only a layer's `valid`) and none recomputes
        rows or runs between layers (`revival`, `after_layers`, a host loop). There
        `after_step` is given no cache (None): a method whose `after_step` reads the cache
        answers False."""
        cls = type(self)
        return not self.steps_on_host() and all(
            getattr(cls, h) is getattr(Method, h) for h in ("revival", "revived", "after_layers"))
