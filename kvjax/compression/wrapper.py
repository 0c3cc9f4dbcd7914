"""A method that wraps another (kvpress's "press of a press"): `base` is a field, and every
hook the wrapper does not override is the base's. CriticalKV (`kvjax.methods.critical`)
changes only which entries fill the base's budgets; the rest is forwarded here, once, for
any wrapper and any base.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.compression.method import Method
from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Wrapper(Method):
    """Every hook forwarded to `base`; the methods that return a method return this
    wrapper around the base's answer."""

    base: Method = Method()

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__.lower()}({self.base.name})"

    @property
    def positional(self) -> bool:  # type: ignore[override]
        return self.base.positional

    @property
    def prefill_kind(self) -> str:  # type: ignore[override]
        return self.base.prefill_kind

    @property
    def float_budget(self) -> bool:  # type: ignore[override]
        return self.base.float_budget

    def _around(self, base: Method) -> "Wrapper":
        return dataclasses.replace(self, base=base)

    # ---- methods of a method ------------------------------------------------------------

    def validate(self, n: int, cfg: ModelConfig) -> None:
        self.base.validate(n, cfg)

    def with_budget(self, budget: int) -> "Wrapper":
        return self._around(self.base.with_budget(budget))

    def takes_budget(self) -> bool:
        return self.base.takes_budget()

    def budget_for(self, n: int) -> int | float | None:
        return self.base.budget_for(n)

    def with_ratio(self, ratio: float, n: int) -> "Wrapper":
        return self._around(self.base.with_ratio(ratio, n))

    def for_prompt(self, n: int) -> "Wrapper":
        return self._around(self.base.for_prompt(n))

    def extension_phases(self):
        phases = self.base.extension_phases()
        return None if phases is None else tuple(self._around(m) for m in phases)

    # ---- every hook -----------------------------------------------------------------------

    def kept_slots(self, n: int) -> int:
        return self.base.kept_slots(n)

    def cache_slots(self, n: int, cfg: ModelConfig) -> int:
        return self.base.cache_slots(n, cfg)

    def init_state(self, cfg: ModelConfig, batch: int, n: int) -> Any:
        return self.base.init_state(cfg, batch, n)

    def after_layer_prefill(self, io, state: Any):
        return self.base.after_layer_prefill(io, state)

    def finalize(self, kv, aux, state: Any):
        return self.base.finalize(kv, aux, state)

    def splits_heads(self) -> bool:
        return self.base.splits_heads()

    def next_position(self, kv, pos_BT, valid_BT):
        return self.base.next_position(kv, pos_BT, valid_BT)

    def decode_capacity(self, kept: int, question: int, max_new: int) -> int:
        return self.base.decode_capacity(kept, question, max_new)

    def pad_state(self, state: Any, capacity: int) -> Any:
        return self.base.pad_state(state, capacity)

    def decode_slots(self, cache, state: Any, T: int):
        return self.base.decode_slots(cache, state, T)

    def decode_layer(self, io, probs, state: Any):
        return self.base.decode_layer(io, probs, state)

    def revival(self, layer, state: Any):
        return self.base.revival(layer, state)

    def revived(self, layer, x_BRD, state: Any) -> Any:
        return self.base.revived(layer, x_BRD, state)

    def after_step(self, cfg: ModelConfig, cache, state: Any) -> Any:
        return self.base.after_step(cfg, cache, state)

    def after_layers(self, cfg: ModelConfig, cache, state: Any, upto: int) -> Any:
        return self.base.after_layers(cfg, cache, state, upto)

    def uses_decode_layer(self) -> bool:
        return self.base.uses_decode_layer()

    def steps_on_host(self) -> bool:
        return self.base.steps_on_host()

    def decode_segments(self, cfg: ModelConfig) -> tuple[int, ...]:
        return self.base.decode_segments(cfg)

    def between_segments(self, host, i: int, cache, state: Any, done):
        return self.base.between_segments(host, i, cache, state, done)

    def between_steps(self, host, cache, state: Any, done):
        return self.base.between_steps(host, cache, state, done)

    def init_host(self, cfg: ModelConfig, cache, state: Any, compile):
        return self.base.init_host(cfg, cache, state, compile)

    def decode_stats(self, host, state: Any) -> dict:
        return self.base.decode_stats(host, state)

    def static_after_prefill(self) -> bool:
        return self.base.static_after_prefill()

    def plain_decode(self) -> bool:
        return self.base.plain_decode()

    def layered_hooks(self) -> bool:
        return self.base.layered_hooks()

    # ---- the token-selection and block-pruning prefills' hooks (`protocols`) -----------
    # (forwarded by name, not by __getattr__: `hasattr(wrapper, field)` must stay False
    # for the base's fields, which code that rebuilds a method reads as "mine")

    def token_plan(self, n: int):
        return self.base.token_plan(n)

    def token_scores(self, q, k, valid, kernels):
        return self.base.token_scores(q, k, valid, kernels)

    def init_exit(self, cfg: ModelConfig, P: int):
        return self.base.init_exit(cfg, P)

    def exit_test(self, layer, s_KP, valid_P, ex, cfg: ModelConfig):
        return self.base.exit_test(layer, s_KP, valid_P, ex, cfg)

    def exit_stats(self, ex, relvar) -> dict:
        return self.base.exit_stats(ex, relvar)

    def plan(self, cfg: ModelConfig, T: int):
        return self.base.plan(cfg, T)

    def group_scores(self, q_tail, k_BKSD, valid_BS):
        return self.base.group_scores(q_tail, k_BKSD, valid_BS)

    def choose_groups(self, i: int, plan, s_BG, blk_BG, glive_BG, n_B):
        return self.base.choose_groups(i, plan, s_BG, blk_BG, glive_BG, n_B)

    def block_state(self, plan, T: int, n_B, pruned: list[dict]):
        return self.base.block_state(plan, T, n_B, pruned)
