"""The host-side driver: one generation, from token ids to tokens and measured statistics.

`run` checks the request, pads the batch, prefills with the method's compression, prefills
a context-only question on top, decodes, and reports. Timings exclude compilation, which
is reported on its own (`compile_s`), and the kernel implementation each op actually ran
is recorded (`kernels`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from kvjax.compress import cache as kvcache
from kvjax.compress.method import Method
from kvjax.config import ModelConfig
from kvjax.engine import steps
from kvjax.engine.executables import compile_once
from kvjax.engine.inputs import bucket, pad_left
from kvjax.engine.sampling import Sampling
from kvjax.pallas.dispatch import Kernels

# keys of `Generation.stats` that the engine itself measures (the rest come from the method)
ENGINE_STATS = ("kv_bytes_live", "kv_bytes_allocated", "kv_bytes_full", "ttft_s", "tpot_s",
                "compile_s", "prompt_tokens", "kernels")


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per element, stop token excluded
    cache: kvcache.KVCache
    stats: dict[str, Any]
    state: Any = None  # the method's state after the last step (host bookkeeping if any)


@dataclasses.dataclass
class _Clock:
    """What the phases of one run measured: time to first token, compilation, decoding,
    and the kernel ops the compiled programs used."""

    ttft_s: float = 0.0
    compile_s: float = 0.0
    decode_s: float = 0.0
    kernels: set = dataclasses.field(default_factory=set)

    def compiled(self, fn, args, **static):
        exe, secs, used = compile_once(fn, args, **static)
        self.compile_s += secs
        self.kernels |= used
        return exe

    def timed(self, exe, *args, phase: str = "ttft_s"):
        t0 = time.perf_counter()
        out = jax.block_until_ready(exe(*args))
        setattr(self, phase, getattr(self, phase) + time.perf_counter() - t0)
        return out


def check_request(cfg: ModelConfig, prompts, questions, method: Method, max_new_tokens: int):
    """Refuse, with the bad value named, what the model or the method cannot run."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    if questions is not None and len(questions) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(questions)} questions")
    for seq in (*prompts, *(questions or ())):
        bad = [t for t in seq if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary "
                             f"[0, {cfg.vocab_size})")
    longest = max(len(p) + len(q) for p, q in zip(prompts, questions or [[]] * len(prompts)))
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}")
    for p in prompts:
        method.validate(len(p), cfg)
    if not method.positional and cfg.sliding_window is not None and longest > cfg.sliding_window:
        # the model's attention would not see past its window, but the methods' scores
        # (window attention, cumulative sums, merges) see the whole causal prefix
        raise ValueError(
            f"prompt of {longest} tokens exceeds the model's sliding_window="
            f"{cfg.sliding_window}: method {method.name!r} scores the whole causal prefix; "
            "only methods that choose by position ('full', 'streaming_llm') run beyond it")


def _placed(arrays, sharding):
    return arrays if sharding is None else jax.device_put(arrays, sharding)


def _prefill(params, cfg, prompts, method, kernels, Tq, max_new, shrink_ok, sharding, clock):
    """Prefill + compression (and, for append-only methods, dropping the dead slots):
    (logits, cache, state, stats)."""
    T = bucket(max(len(p) for p in prompts))
    tokens, valid = _placed(pad_left(prompts, T, cfg.pad_token_id), sharding)
    capacity = method.decode_capacity(method.cache_slots(T, cfg), Tq, max_new)
    pre = clock.compiled(steps.prefill_extent, (params, tokens, valid), cfg=cfg, method=method,
                         capacity=capacity, kernels=kernels)
    logits, cache, state, stats, extent = clock.timed(pre, params, tokens, valid)
    if shrink_ok and method.static_after_prefill():
        # Methods with per-head or per-layer budgets (AdaKV, PyramidKV, LAVa, CAKE, HeadKV)
        # allocate room for the most any head could keep; decoding over the dead slots
        # would cost as much as the full cache. Drop them (a bucketed count: few shapes).
        slots = bucket(max(int(extent), 1), 1)
        if slots < cache.capacity - Tq - max_new:
            cut = clock.compiled(steps.shrink, (cache,), slots=slots,
                                 capacity=slots + Tq + max_new)
            cache = clock.timed(cut, cache)
    return logits, cache, state, stats


def _question(params, cfg, questions, Tq, method, kernels, cache, state, sharding, clock):
    """The context-only scenario: the question prefilled on top of the compressed context."""
    qt, qv = _placed(pad_left(questions, Tq, cfg.pad_token_id), sharding)
    ext = clock.compiled(steps.extend, (params, cache, qt, qv, state), cfg=cfg, method=method,
                         kernels=kernels)
    return clock.timed(ext, params, cache, qt, qv, state)


def _decode(params, cfg, cache, logits, state, method, kernels, max_new, sampling, stop_ids,
            seed, clock):
    """(tokens [B, max_new], counts [B], cache, state, the method's decode stats)."""
    rng = jax.random.PRNGKey(seed)
    if method.steps_on_host():
        out, n, cache, state, host, c, used, secs = steps.host_decode(
            params, cfg, cache, logits, rng, state, method=method, max_new=max_new,
            sampling=sampling, stop_ids=stop_ids, kernels=kernels)
        clock.compile_s += c
        clock.kernels |= used
        clock.decode_s += secs
        return out, n, cache, host, method.decode_stats(host, state)
    dec = clock.compiled(steps.decode, (params, cache, logits, rng, state), cfg=cfg,
                         method=method, max_new=max_new, sampling=sampling, stop_ids=stop_ids,
                         kernels=kernels)
    out, n, cache, state = clock.timed(dec, params, cache, logits, rng, state, phase="decode_s")
    return out, n, cache, state, method.decode_stats(None, state)


def _kernels_used(used: set) -> dict[str, str]:
    """{op: implementation} of the ops the run's programs called ("a, b" if several)."""
    by_op: dict[str, set] = {}
    for op, impl in used:
        by_op.setdefault(op, set()).add(impl)
    return {op: ", ".join(sorted(v)) for op, v in sorted(by_op.items())}


def run(
    params,
    cfg: ModelConfig,
    prompts: list[list[int]],
    method: Method | None = None,
    *,
    questions: list[list[int]] | None = None,
    max_new_tokens: int = 32,
    sampling: Sampling = Sampling(),
    stop_ids: tuple[int, ...] | None = None,
    seed: int = 0,
    batch_sharding=None,
    shrink: bool = True,
    kernels: Kernels = Kernels(),
) -> Generation:
    """Compress each prompt (and, context-only, append its question), then decode.

    `shrink`: drop the slots no head uses before decoding, for methods that only append
    while decoding (same tokens, less to attend over); False keeps the prefill's layout.
    `batch_sharding` (see `kvjax.distributed`) places the token arrays across devices;
    `kernels` picks the kernel implementation of each op (a static part of every program).
    """
    method = method or Method()
    check_request(cfg, prompts, questions, method, max_new_tokens)
    stop_ids = tuple(cfg.eos_token_ids) if stop_ids is None else tuple(stop_ids)
    Tq = bucket(max(len(q) for q in questions), 1) if questions else 0
    clock = _Clock()
    logits, cache, state, stats = _prefill(params, cfg, prompts, method, kernels, Tq,
                                           max_new_tokens, shrink, batch_sharding, clock)
    if questions:
        logits, cache, state = _question(params, cfg, questions, Tq, method, kernels, cache,
                                         state, batch_sharding, clock)
    live_after_prefill = kvcache.kv_bytes(cache)
    B = len(prompts)
    out, n, decode_stats = np.zeros((B, 0), np.int32), np.zeros(B, int), {}
    if max_new_tokens > 0:
        out, n, cache, state, decode_stats = _decode(
            params, cfg, cache, logits, state, method, kernels, max_new_tokens, sampling,
            stop_ids, seed, clock)
    out, n = np.asarray(out), np.asarray(n)
    steps_run = min(int(n.max()) + 1, max_new_tokens) if max_new_tokens else 0
    n_in = sum(len(p) for p in prompts) + sum(len(q) for q in questions or [])
    stats = {
        **{k: np.asarray(v).tolist() for k, v in stats.items()},
        **decode_stats,
        "kv_bytes_live": live_after_prefill["kv_bytes_live"],
        "kv_bytes_allocated": live_after_prefill["kv_bytes_allocated"],
        "kv_bytes_full": kvcache.full_kv_bytes(cfg, n_in, cache.k.dtype),
        "ttft_s": clock.ttft_s,
        "tpot_s": clock.decode_s / steps_run if steps_run else None,
        "compile_s": clock.compile_s,
        "prompt_tokens": [len(p) for p in prompts],
        "kernels": _kernels_used(clock.kernels),
    }
    return Generation([out[i, : n[i]].tolist() for i in range(B)], cache, stats, state)
