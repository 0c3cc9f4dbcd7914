"""What each engine path calls on a method, beyond `Method`'s hooks (docs/design.md, "Hooks").

`Method.prefill_kind` picks the prefill loop; the two loops that change the prefill itself
call hooks of their own, declared here so that a new method family sees what it must
implement (and `Method.__post_init__` refuses a class that lacks one, naming it):

- `TokenSelection` (`prefill_kind = "token_selection"`, `kvjax.engine.token_selection`):
  tokens are chosen once, at a layer the method's exit test picks (ASL, FastKV, GemFilter).
- `BlockPruning` (`prefill_kind = "block_pruning"`, `kvjax.engine.block_pruning`): blocks of
  hidden states are pruned at static stages (SlimInfer, LazyLLM).

Two more say what a wrapper (`kvjax.compression.wrapper.Wrapper`, e.g. CriticalKV) may ask
of the method it wraps, whatever its family:

- `ScoredEviction`: chooses per head from scores at each prefill layer, the choice left to
  a `Chooser` (the SnapKV family, HeadKV: `PrefillEviction.evict_layer`).
- `FinalSelection`: decides its per-head counts after the layer scan and fills them with a
  `Chooser` (the cascading LAVa and CAKE: `Cascading.select_final`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from kvjax.config import ModelConfig


@runtime_checkable
class TokenSelection(Protocol):
    """The token-selection prefill's hooks (`kvjax.engine.token_selection`)."""

    def token_plan(self, n: int) -> Any:
        """The static plan (`kvjax.methods.asl.layerwise.TokenPlan`) for an n-token prompt."""

    def token_scores(self, q, k, valid, kernels) -> Any:
        """[B, K, P] per-KV-head scores of the prefix tokens at a candidate layer."""

    def init_exit(self, cfg: ModelConfig, P: int) -> Any:
        """The exit test's state before the first layer."""

    def exit_test(self, layer, s_KP, valid_P, ex, cfg: ModelConfig) -> tuple:
        """(select at this layer?, exit state, relative variance or nan)."""

    def exit_stats(self, ex, relvar) -> dict:
        """What the exit test adds to the run's statistics."""


@runtime_checkable
class BlockPruning(Protocol):
    """The block-pruning prefill's hooks (`kvjax.engine.block_pruning`)."""

    def plan(self, cfg: ModelConfig, T: int) -> Any:
        """The static schedule (`kvjax.methods.slim.blocks.Plan`) for a T-token prompt."""

    def group_scores(self, q_tail, k_BKSD, valid_BS) -> tuple:
        """(group scores, unit keys or None) at a pruning layer."""

    def choose_groups(self, i: int, plan, s_BG, blk_BG, glive_BG, n_B) -> Any:
        """[B, G] the groups kept at pruning stage i."""

    def block_state(self, plan, T: int, n_B, pruned: list[dict]) -> Any:
        """The decode state from what each pruning layer saw (None: none needed)."""


@runtime_checkable
class ScoredEviction(Protocol):
    """Chooses what each prefill layer keeps per head from scores; `choose` picks the slots."""

    def evict_layer(self, io, state: Any, choose) -> tuple:
        """`after_layer_prefill` with the choice made by `choose`."""


@runtime_checkable
class FinalSelection(Protocol):
    """Decides its per-head counts after the layer scan; `choose` fills them."""

    def select_final(self, kv, state: Any, choose) -> tuple:
        """`finalize` with the choice made by `choose`."""


REQUIRED: dict[str, type] = {"token_selection": TokenSelection,
                             "block_pruning": BlockPruning}


def missing(method, protocol: type) -> list[str]:
    """The hooks of `protocol` that `method` lacks."""
    names = [n for n in vars(protocol) if not n.startswith("_") and callable(vars(protocol)[n])]
    return [n for n in names if not callable(getattr(method, n, None))]


def check_interface(method) -> None:
    """Raise TypeError naming the hooks a method's `prefill_kind` needs and it lacks."""
    protocol = REQUIRED.get(method.prefill_kind)
    if protocol is not None and (lack := missing(method, protocol)):
        raise TypeError(f"{type(method).__name__}: prefill_kind={method.prefill_kind!r} needs "
                        f"the {protocol.__name__} hooks (kvjax.compression.protocols); "
                        f"missing: {', '.join(lack)}")
