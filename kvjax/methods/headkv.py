"""HeadKV (Fu et al., ICLR 2025, arXiv 2410.19258): static per-head budgets from offline
retrieval-reasoning head scores, SnapKV selection inside each head.

Budgets: `kvjax.headkv.budget_table` (paper Sec. 3.2; authors' `ReasonSnapKVCluster`):
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
(`python scripts/headkv_scores.py`; a test checks the weights hash).
Budgets are static (host numpy from the file), so the cache has `max b_{l,h}` slots.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax import headkv, select
from kvjax.config import ModelConfig
from kvjax.methods import register
from kvjax.methods.eviction import real_length
from kvjax.methods.snapkv import WindowScored
from kvjax.models import transformer
from kvjax.models.transformer import LayerIO


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
        s = headkv.load_scores(self.head_scores, cfg)
        return headkv.budget_table(s, self.budget, self.window, self.beta, self.temp,
                                   cfg.num_kv_heads)

    def cache_slots(self, n: int, cfg: ModelConfig) -> int:
        return int(min(n, self.table(cfg).max()))

    def head_budgets(self, io: LayerIO, s_BKT, table_LK):
        """[B, K] this layer's budgets, at most each prompt's real length; no extra."""
        b = jnp.minimum(table_LK[io.layer][None, :], real_length(io)[:, None])
        return b, None

    def keep(self, io: LayerIO, s_BKT, S: int, table_LK):
        b, _ = self.head_budgets(io, s_BKT, table_LK)
        return select.slots_from_scores(s_BKT, b, S)

    def prefill(self, params, cfg: ModelConfig, tokens_BT, valid_BT, pos_BT):
        # the slot count is static and needs the model (the budget table), which
        # `after_layer_prefill`'s `head_slots(T, K)` does not see: bind it here
        T = tokens_BT.shape[1]
        S = self.cache_slots(T, cfg)

        def hook(io: LayerIO, table_LK):
            idx, live = self.keep(io, self.scores(io), S, table_LK)
            return select.gather(io.k, io.v, io.pos, io.valid, idx, live), table_LK

        table = jnp.asarray(self.table(cfg))
        x, kv, _ = transformer.prefill(params, cfg, tokens_BT, valid_BT, pos_BT, hook, table)
        kv, state, stats = self.finalize(kv, None)
        return x[:, -1], kv, state, stats

