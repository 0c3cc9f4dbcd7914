"""Greedy and nucleus sampling of the next token."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise temperature then nucleus (top_p) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits_BV: Array, rng: Array, sampling: Sampling) -> Int[Array, "B"]:
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV.astype(jnp.float32) / sampling.temperature
    if sampling.top_p < 1:
        sorted_ = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_, axis=-1), axis=-1)
        # smallest logit still inside the nucleus (the top token always is)
        cut_idx = jnp.sum(cum - jax.nn.softmax(sorted_, axis=-1) < sampling.top_p, axis=-1) - 1
        cut = jnp.take_along_axis(sorted_, cut_idx[:, None], axis=-1)
        logits = jnp.where(logits < cut, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
