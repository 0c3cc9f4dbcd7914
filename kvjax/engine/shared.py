"""One prefill, many methods: the full prefill of a batch run once, and each method that
compresses after it replays its hooks on what that prefill recorded.

Every `prefill_kind == "scan"` method (the SnapKV family, AdaKV, PyramidKV, HeadKV, TOVA,
H2O, StreamingLLM, their CriticalKV forms, LAVa, CAKE, D2O, ...) runs the model's plain
full prefill: its hook only chooses what each layer keeps, and the hidden states go on
unchanged. So a sweep of such methods on the same prompts runs the model once
(`prefill_record`: the last-token logits, each layer's q, k, v and, where the prompt
attention computed it, each query's log-sum-exp) and each method's
compression alone (`replay_extent`), with the same tokens as a separate run
(tests/test_shared_prefill.py). Methods that change the prefill itself (ASL, FastKV,
GemFilter: token selection; SlimInfer, LazyLLM: block pruning) run their own.

The record holds q, k and v of every layer at once: for SmolLM2-135M that is 30 x 3 x
B T x (9 + 2 x 3) x 64 floats, 0.9 GB at B = 8, T = 2048 in float32. The fused prefill
never holds more than one layer's; `kvjax.engine.run` without `prefilled` stays the
low-memory path.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvjax.compression.method import Method
from kvjax.config import ModelConfig
from kvjax.engine import steps
from kvjax.engine.clock import Clock
from kvjax.engine.inputs import bucket, pad_left
from kvjax.pallas.dispatch import Kernels


@dataclasses.dataclass
class Prefilled:
    """A batch's full prefill, recorded for the methods that compress after it."""

    tokens: np.ndarray  # [B, T] the padded prompt tokens it was run on
    valid: np.ndarray  # [B, T]
    logits: jax.Array  # [B, V] of the last prompt token
    q: jax.Array  # [L, B, T, H, Dh] (RoPE applied)
    k: jax.Array  # [L, B, K, T, Dh]
    v: jax.Array
    lse: jax.Array | None  # [L, B, K, G, T] the attention's log-sum-exp, where it had one
    prefill_s: float  # the timed prefill (compilation excluded)
    compile_s: float
    kernels: Kernels  # the run's kernel choices after any `auto` fallback
    used: frozenset  # {(op, implementation)} the prefill program ran

    def take(self, rows: list[int]) -> Prefilled:
        """The record of `rows` of the batch alone, as a prefill of those prompts would have
        made it: the rows, and the padded length cut from the left to the bucket of their
        longest prompt (left padding: what is cut is padding in every row kept). The time
        is the whole batch's: these rows waited for all of it."""
        lengths = self.valid[rows].sum(axis=1)
        T = self.tokens.shape[1]
        cut = T - bucket(int(lengths.max()))
        r = np.asarray(rows)
        return dataclasses.replace(
            self, tokens=self.tokens[r, cut:], valid=self.valid[r, cut:], logits=self.logits[r],
            q=self.q[:, r, cut:], k=self.k[:, r, :, cut:], v=self.v[:, r, :, cut:],
            lse=None if self.lse is None else self.lse[:, r, ..., cut:])

    def check(self, cfg: ModelConfig, prompts) -> None:
        """Refuse a record made from other prompts than `prompts`."""
        tokens, _ = pad_left(prompts, bucket(max(len(p) for p in prompts)), cfg.pad_token_id)
        if tokens.shape != self.tokens.shape or not np.array_equal(tokens, self.tokens):
            raise ValueError(f"prefilled: recorded for other prompts (padded shape "
                             f"{self.tokens.shape}) than the {len(prompts)} given "
                             f"(padded shape {tokens.shape})")


def shares(method: Method) -> bool:
    """Whether `method` compresses after the plain full prefill (and so can replay a
    `Prefilled`)."""
    return method.prefill_kind == "scan"


def prefill(params, cfg: ModelConfig, prompts, kernels: Kernels = Kernels()) -> Prefilled:
    """Run the batch's full prefill once and keep what the methods' hooks read."""
    tokens, valid = pad_left(prompts, bucket(max(len(p) for p in prompts)), cfg.pad_token_id)
    clock = Clock(kernels)
    exe = clock.compiled(steps.prefill_record, (params, tokens, valid), cfg=cfg)
    logits, q, k, v, lse = clock.timed(exe, params, tokens, valid)
    return Prefilled(tokens, valid, logits, q, k, v, lse, clock.ttft_s, clock.compile_s,
                     clock.config, frozenset(clock.kernels))
