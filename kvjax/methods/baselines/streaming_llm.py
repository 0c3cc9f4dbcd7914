"""StreamingLLM (Xiao et al. 2024, "Efficient streaming language models with attention
sinks").

Keeps the first `n_sink` tokens (attention sinks) and the most recent
`budget - n_sink`: `budget` counts both. After prefill this is kvpress
`StreamingLLMPress` (n_sink 4); while decoding, every new token is written into the slot
of the oldest non-sink entry once the budget is full, so exactly `budget` entries stay
live at every step (the paper's rolling cache). Keys keep their original RoPE positions
(kvpress's default; the paper re-rotates keys to positions inside the cache -- kvpress
needs `KeyRerotationPress` for that, kvjax does not implement it).

Defaults: n_sink 4 (paper Sec. 3.2 and kvpress).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.compression.eviction import DecodeEviction, force
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.registry import register


@register
@dataclasses.dataclass(frozen=True)
class StreamingLLM(DecodeEviction):
    """StreamingLLM: `n_sink` first tokens + the `budget - n_sink` most recent, kept at
    every decoding step."""

    name: ClassVar[str] = "streaming_llm"
    positional: ClassVar[bool] = True
    forced_what: ClassVar[str] = "the attention sinks"
    budget: int = 128
    n_sink: int = 4

    def splits_heads(self) -> bool:
        return True  # positions only

    @property
    def forced(self) -> int:
        return self.n_sink

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if self.n_sink < 0:
            raise ValueError(f"n_sink={self.n_sink} must be >= 0")
        super().validate(n, cfg)

    def scores(self, io: LayerIO):
        valid = io.valid[:, 0]
        pos = io.pos[:, 0].astype(jnp.float32)  # the most recent score highest
        s = jnp.broadcast_to(pos[:, None], io.valid.shape)
        return force(s, valid & (io.pos[:, 0] < self.n_sink), valid)

    def decode_scores(self, io: LayerIO, probs, state):
        return io.pos.astype(jnp.float32), io.pos >= self.n_sink, state
