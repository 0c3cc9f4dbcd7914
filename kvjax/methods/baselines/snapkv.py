"""SnapKV (Li et al. 2024, "SnapKV: LLM knows what you are looking for before generation").

Score (LAVa paper Eq. 20; SnapKV Sec. 4 / Listing 1): the last `window` prompt queries
attend to the prefix, softmax in fp32 over every key they see; the prefix columns are
averaged over the window, pooled along the tokens (stride 1, same length) and averaged
over the query heads of each KV head (GQA mean, kvpress and the AdaKV code; see
SnapKV issue #22). Each (layer, KV head) keeps the window plus the top `budget - window`
prefix entries: `budget` counts the window.

Defaults: window 32, max pooling, kernel 7 -- the setting of the papers kvjax
reproduces (AdaKV, CriticalKV and LAVa run SnapKV with it; docs/methods.md, "Baselines"). The
SnapKV authors' code defaults to window 32, avgpool kernel 5 (`--set pooling=avg
--set kernel=5`); kvpress `SnapKVPress` uses window 64, avgpool kernel 5
(`--set window=64 --set pooling=avg --set kernel=5`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.compression.eviction import WindowScored
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(WindowScored):
    """SnapKV: uniform `budget` per (layer, KV head) = window + top (budget - window)
    prefix entries by pooled window attention (window 32, maxpool 7, GQA mean)."""

    name: ClassVar[str] = "snapkv"

    def splits_heads(self) -> bool:
        return True  # per-head window scores and top-k
