"""PyramidKV (Cai et al. 2024, "PyramidKV: dynamic KV cache compression based on pyramidal
information funneling").

SnapKV's score (window attention, pooled, GQA mean), with per-layer budgets on a linear
pyramid (LAVa paper Eq. 21): the first layer keeps `2B - B/beta`, the last `B/beta`, the
mean over layers is `budget` (window included in every layer's count). The schedule is
kvpress `PyramidKVPress.get_layer_budget` exactly (`kvjax.compression.budgets.pyramid`): the first
layer is capped at `n - window` (the last raised to keep the mean), and when the smallest
layer budget would fall below the window, every layer keeps `budget` (kvpress's "fall
back to SnapKV"). With beta 20 that fallback applies whenever `budget < 20 * window`.

`--ratio r` (`with_ratio`) sets the average budget to kvpress's float `n (1 - r)`, not its
integer part: the schedule is then kvpress's at any n (n = 640, r = 0.8: B = 127.99...97,
whose layers keep 128 where `int` would keep 127), and `budget` holds that float.

Defaults: beta 20 (kvpress; KVCache-Factory), window 32, maxpool 7, GQA mean as SnapKV
(the LAVa paper runs PyramidKV with maxpool 7 and tunes beta in {5, 10, 20}).
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.compression import budgets
from kvjax.compression.eviction import WindowScored, real_length
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.registry import register


@lru_cache(maxsize=64)
def _table(budget: float, n_max: int, num_layers: int, window: int, beta: float) -> np.ndarray:
    return budgets.pyramid_table(budget, n_max, num_layers, window, beta)


class PyramidSchedule:
    """Mixin: per-layer budgets from the pyramid table, per batch element (its length).

    The table [N + 1, L] rides in the prefill state (built in `init_state`, where the
    depth is known) and is indexed with the element's length and the traced layer.
    """

    float_budget = True  # `with_ratio` keeps kvpress's float n (1 - r) as the mean

    def validate_beta(self):
        if self.beta < 1:
            raise ValueError(f"beta={self.beta} must be >= 1")

    def init_state(self, cfg: ModelConfig, batch: int, n: int):
        return jnp.asarray(_table(self.budget, n, cfg.num_layers, self.window, float(self.beta)))

    def head_count(self, io: LayerIO, table):
        """[B] this layer's per-head budget for each element (traced layer index)."""
        n = jnp.minimum(real_length(io), table.shape[0] - 1)
        return table[n, io.layer]

    def max_head_count(self, n: int) -> int:
        # layer 0 holds the largest budget and does not depend on the depth
        return int(_table(self.budget, n, 2, self.window, float(self.beta))[:, 0].max())

    def finalize(self, kv, aux, state):
        return super().finalize(kv, aux, None)  # the table is not decode state


@register
@dataclasses.dataclass(frozen=True)
class PyramidKV(PyramidSchedule, WindowScored):
    """PyramidKV: SnapKV scores, layer l keeps round(max - l (max - min) / (L - 1)) per
    KV head (window included), mean `budget`; beta 20."""

    name: ClassVar[str] = "pyramidkv"
    beta: float = 20

    def splits_heads(self) -> bool:
        return True  # per-head scores; the layer's count from a replicated table

    def validate(self, n: int, cfg: ModelConfig) -> None:
        super().validate(n, cfg)
        self.validate_beta()

    def with_ratio(self, ratio: float, n: int) -> "PyramidKV":
        """kvpress's arithmetic: the schedule's average budget is the float n (1 - r)
        (`PyramidKVPress.get_layer_budget`), never its integer part."""
        super().with_ratio(ratio, n)  # the range check
        return dataclasses.replace(self, budget=n * (1 - ratio))

    def kept_slots(self, n: int) -> int:
        return min(max(self.max_head_count(n), math.ceil(self.budget)), n)

