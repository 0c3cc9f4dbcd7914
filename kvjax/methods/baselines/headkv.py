"""HeadKV (Fu et al., ICLR 2025, arXiv 2410.19258): static per-head budgets from offline
retrieval-reasoning head scores, SnapKV selection inside each head.

Budgets: `kvjax.methods.baselines.head_scores.budget_table` (paper Sec. 3.2; authors' `ReasonSnapKVCluster`):
`b_{l,h} = round(p_{l,h} * (base // beta) * L * K + base - base // beta) + window`, p the
normalised head scores of `kvjax/assets/head_scores/<model>.json` (summed over each KV
head's query heads), `base = budget - window`. The total over heads is `L * K * budget` up
to rounding; every head keeps at least its window. Inside a head: the window plus the top
`b_{l,h} - window` prefix entries by SnapKV's pooled window score.

Defaults from the authors' code: window 32, maxpool 7, window mean (`ReasonSnapKVCluster`);
`beta = 1.005` (their LongBench script `head_start_llama3.sh` runs `betas[0]`; they sweep
1.005-10 -- a larger beta is a smaller pool), `temp = 1`, retrieval-reasoning scores. GQA
mean over the group for the token scores (kvjax's SnapKV family).

`head_scores`: None finds the file whose recorded config equals the model's; a model name or
a path picks one. A model without scores fails in `validate` with the expected file.
The bundled model's file (`kvjax/assets/head_scores/tiny-retrieval.json`) was computed on
the shipped weights (MODEL.md): recompute it whenever the model is re-exported
(`python -m kvjax.headkv_scores`; a test checks the weights hash).
Budgets are static (host numpy from the file), so the cache has `max b_{l,h}` slots.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.compression.eviction import HeadBudgets, WindowScored, real_length
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.baselines import head_scores
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class HeadKV(WindowScored):
    """HeadKV-R2: per-head budgets from retrieval-reasoning head scores (beta 1.005, temp 1),
    SnapKV selection inside each head (window 32, maxpool 7)."""

    name: ClassVar[str] = "headkv"
    beta: float = 1.005
    temp: float = 1.0
    head_scores: str | None = None

    def validate(self, n: int, cfg: ModelConfig) -> None:
        super().validate(n, cfg)
        if self.beta < 1:
            raise ValueError(f"beta={self.beta} must be >= 1 (the pool is base // beta per head)")
        if self.temp <= 0:
            raise ValueError(f"temp={self.temp} must be > 0")
        self.table(cfg)  # a model without scores fails here, before tracing

    def table(self, cfg: ModelConfig) -> np.ndarray:
        """[L, K] budgets per (layer, KV head), window included."""
        s = head_scores.load_scores(self.head_scores, cfg)
        return head_scores.budget_table(s, self.budget, self.window, self.beta, self.temp,
                                        cfg.num_kv_heads)

    def cache_slots(self, n: int, cfg: ModelConfig) -> int:
        return int(min(n, self.table(cfg).max()))

    def init_state(self, cfg: ModelConfig, batch: int, n: int):
        return jnp.asarray(self.table(cfg))  # [L, K], indexed by the traced layer

    def head_budgets(self, io: LayerIO, s_BKT, table_LK) -> HeadBudgets:
        """This layer's budgets [B, K], at most each prompt's real length."""
        return HeadBudgets(jnp.minimum(table_LK[io.layer][None, :], real_length(io)[:, None]))

    def finalize(self, kv, aux, state):
        return super().finalize(kv, aux, None)  # the table is not decode state
