"""Prompt batches as fixed shapes: lengths bucketed, sequences left-padded, positions.

Prompt lengths are bucketed (four buckets per octave), so nearby lengths share a
compilation, and left-padded, so every element's last prompt token sits at the same index.
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from kvjax.compression.budgets import quarter_octave


def bucket(n: int, minimum: int = 16) -> int:
    """Round a length up to one of four buckets per octave (<= 25% padding): the grid of
    `budgets.length_scale`, from which length-proportional defaults are computed."""
    return minimum if n <= minimum else quarter_octave(n)


def pad_left(seqs: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, length] tokens and validity, each sequence right-aligned."""
    tokens = np.full((len(seqs), length), pad_id, np.int32)
    valid = np.zeros((len(seqs), length), bool)
    for i, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than the padded length {length}")
        if len(s):
            tokens[i, length - len(s):] = s
            valid[i, length - len(s):] = True
    return tokens, valid


def positions(valid_BT: Bool[Array, "B T"], start_B: Int[Array, "B"]) -> Int[Array, "B T"]:
    """Original positions: padding consumes none (left padding keeps the prompt at 0..n-1)."""
    return start_B[:, None] + jnp.cumsum(valid_BT, axis=1, dtype=jnp.int32) - 1
