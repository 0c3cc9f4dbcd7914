"""Prefill (with the method's compression inside the layer scan) and a jitted decode loop.

Everything that runs per token is compiled once: the decode loop is a `lax.while_loop`
whose carry holds the donated cache, so a whole generation is one program and no host
sync happens between steps. Prompt lengths are bucketed (four buckets per octave) and
left-padded, so nearby lengths share a compilation and every element's last prompt token
sits at the same index.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from kvjax import cache as kvcache
from kvjax.config import ModelConfig
from kvjax.methods.base import Method
from kvjax.models import transformer


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise temperature then nucleus (top_p) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def bucket(n: int, minimum: int = 16) -> int:
    """Round a length up to one of four buckets per octave (<= 25% padding)."""
    if n <= minimum:
        return minimum
    step = 2 ** max(int(math.floor(math.log2(n))) - 2, 0)
    return -(-n // step) * step


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


# ---- compiled pieces ------------------------------------------------------------------------


_LIVE_EXTENT = "_live_extent"  # engine-internal prefill output, popped by `run`


@partial(jax.jit, static_argnames=("cfg", "method", "capacity"))
def prefill(params, tokens_BT, valid_BT, *, cfg: ModelConfig, method: Method, capacity: int):
    """Prefill + compression: last-token logits [B, V], cache, method state, method stats."""
    B, T = tokens_BT.shape
    pos_BT = positions(valid_BT, jnp.zeros((B,), jnp.int32))
    x_BD, kv, state, stats = method.prefill(params, cfg, tokens_BT, valid_BT, pos_BT)
    kept = kv[0].shape[3]
    next_pos = method.next_position(kv, pos_BT, valid_BT)
    cache = kvcache.KVCache(*kv, end=jnp.asarray(kept, jnp.int32), next_pos=next_pos)
    cache = kvcache.pad_capacity(cache, capacity)
    state = method.pad_state(state, capacity)
    # reduced here, inside the compiled prefill: `run` reads one integer, not the mask
    stats = {**stats, _LIVE_EXTENT: kvcache.live_extent(cache)}
    return transformer.unembed(params, cfg, x_BD), cache, state, stats


@partial(jax.jit, static_argnames=("slots", "capacity"))
def _shrink(cache, *, slots: int, capacity: int):
    return kvcache.shrink(cache, slots, capacity)


def _extend(params, cache: kvcache.KVCache, tokens_BT, valid_BT, cfg, method, state):
    B, T = tokens_BT.shape
    pos_BT = positions(valid_BT, cache.next_pos)
    slots = method.decode_slots(cache, state, T)
    if slots is None:
        slots = jnp.broadcast_to(cache.end + jnp.arange(T, dtype=jnp.int32),
                                 (cfg.num_layers, B, cfg.num_kv_heads, T))
    kv = (cache.k, cache.v, cache.pos, cache.valid)
    x, kv, state = transformer.extend(params, cfg, tokens_BT, valid_BT, kv, pos_BT, slots,
                                      method.decode_layer, state)
    cache = kvcache.KVCache(*kv, end=cache.end + T,
                            next_pos=cache.next_pos + jnp.sum(valid_BT, axis=1, dtype=jnp.int32))
    return transformer.unembed(params, cfg, x[:, -1]), cache, state


@partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("cache",))
def extend(params, cache, tokens_BT, valid_BT, state=None, *, cfg: ModelConfig, method: Method):
    """Prefill a chunk (e.g. the question, context-only scenario) on top of a cache."""
    return _extend(params, cache, tokens_BT, valid_BT, cfg, method, state)


@partial(jax.jit, static_argnames=("cfg", "method", "max_new", "sampling", "stop_ids"),
         donate_argnames=("cache",))
def decode(params, cache, logits_BV, rng, state=None, *, cfg: ModelConfig, method: Method,
           max_new: int, sampling: Sampling, stop_ids: tuple[int, ...]):
    """Generate up to `max_new` tokens in one `lax.while_loop`.

    Returns tokens [B, max_new] (pad after a stop token), the number of tokens each element
    generated before its stop token, the cache and the method state.
    """
    B = logits_BV.shape[0]
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def cond(c):
        step, _, _, _, done, _, _, _ = c
        return (step < max_new) & ~jnp.all(done)

    def body(c):
        step, cache, logits, out, done, n, rng, st = c
        rng, sub = jax.random.split(rng)
        tok = jnp.where(done, cfg.pad_token_id, sample(logits, sub, sampling))
        out = out.at[:, step].set(tok)
        live = ~done
        stopped = jnp.isin(tok, stops)
        n = n + (live & ~stopped)
        done = done | stopped
        logits, cache, st = _extend(params, cache, tok[:, None], live[:, None], cfg, method, st)
        return step + 1, cache, logits, out, done, n, rng, st

    out = jnp.full((B, max_new), cfg.pad_token_id, jnp.int32)
    init = (jnp.int32(0), cache, logits_BV, out, jnp.zeros((B,), bool),
            jnp.zeros((B,), jnp.int32), rng, state)
    _, cache, _, out, _, n, _, state = jax.lax.while_loop(cond, body, init)
    return out, n, cache, state


# ---- host-side driver ----------------------------------------------------------------------


# keys of `Generation.stats` that the engine itself measures (the rest come from the method)
ENGINE_STATS = ("kv_bytes_live", "kv_bytes_allocated", "kv_bytes_full", "ttft_s", "tpot_s",
                "compile_s", "prompt_tokens")


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per element, stop token excluded
    cache: kvcache.KVCache
    stats: dict[str, Any]
    state: Any = None  # the method's state after the last step


_EXECUTABLES: dict = {}


def compile_once(fn, args: tuple, **static):
    """(executable, compile seconds): `fn` AOT-compiled once per (static args, argument
    shapes); 0.0 seconds when an earlier call compiled it.

    Lowering and compiling explicitly lets the driver time compilation apart from the run;
    the cache makes a second call with the same shapes compile nothing.
    """
    leaves, tree = jax.tree.flatten(args)
    key = (fn, tuple(sorted(static.items())), tree,
           tuple((np.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves))
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    t0 = time.perf_counter()
    _EXECUTABLES[key] = fn.lower(*args, **static).compile()
    return _EXECUTABLES[key], time.perf_counter() - t0


def clear_compiled() -> None:
    """Drop every executable `compile_once` and `jax.jit` hold. Each keeps its machine code
    mapped: a sweep that compiled ~110 (method, budget) pairs in one process ran out of
    memory maps (vm.max_map_count 65530; LLVM: "Cannot allocate memory", SIGSEGV)."""
    _EXECUTABLES.clear()
    jax.clear_caches()


def _block(x):
    jax.block_until_ready(x)
    return x


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
) -> Generation:
    """Compress each prompt (and, context-only, append its question), then decode.

    `shrink`: drop the slots no head uses before decoding, for methods that only append
    while decoding (same tokens, less to attend over); False keeps the prefill's layout.

    Timings exclude compilation: `compile_s` reports it separately (0 when cached).
    `batch_sharding` (see `kvjax.distributed`) places the token arrays across devices.
    """
    method = method or Method()
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
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
    stop_ids = tuple(cfg.eos_token_ids) if stop_ids is None else tuple(stop_ids)
    T = bucket(max(len(p) for p in prompts))
    tokens, valid = pad_left(prompts, T, cfg.pad_token_id)
    if batch_sharding is not None:
        tokens, valid = jax.device_put((tokens, valid), batch_sharding)
    Tq = bucket(max(len(q) for q in questions), 1) if questions else 0
    capacity = method.decode_capacity(method.cache_slots(T, cfg), Tq, max_new_tokens)

    pre, compile_s = compile_once(prefill, (params, tokens, valid), cfg=cfg, method=method,
                               capacity=capacity)
    t0 = time.perf_counter()
    logits, cache, state, stats = _block(pre(params, tokens, valid))
    ttft = time.perf_counter() - t0
    extent = stats.pop(_LIVE_EXTENT)
    if shrink and method.static_after_prefill():
        # Methods with per-head or per-layer budgets (AdaKV, PyramidKV, LAVa, CAKE, HeadKV)
        # allocate room for the most any head could keep; decoding over the dead slots
        # would cost as much as the full cache. Drop them (a bucketed count: few shapes).
        t0, c = time.perf_counter(), 0.0
        slots = bucket(max(int(extent), 1), 1)
        if slots < cache.capacity - Tq - max_new_tokens:
            cut, c = compile_once(_shrink, (cache,), slots=slots,
                                  capacity=slots + Tq + max_new_tokens)
            cache = _block(cut(cache))
        compile_s += c
        ttft += time.perf_counter() - t0 - c
    if questions:
        qt, qv = pad_left(questions, Tq, cfg.pad_token_id)
        if batch_sharding is not None:
            qt, qv = jax.device_put((qt, qv), batch_sharding)
        ext, c = compile_once(extend, (params, cache, qt, qv, state), cfg=cfg, method=method)
        compile_s += c
        t0 = time.perf_counter()
        logits, cache, state = _block(ext(params, cache, qt, qv, state))
        ttft += time.perf_counter() - t0
    live_after_prefill = kvcache.kv_bytes(cache)

    decode_s, out, n = 0.0, np.zeros((len(prompts), 0), np.int32), np.zeros(len(prompts), int)
    if max_new_tokens > 0:
        rng = jax.random.PRNGKey(seed)
        driver = method.decode_driver()
        if driver is not None:  # a method-owned host loop of compiled steps (see Method)
            out, n, cache, state, dstats = driver(
                params, cfg, cache, logits, rng, state, max_new=max_new_tokens,
                sampling=sampling, stop_ids=stop_ids, sample=sample)
            compile_s += dstats.pop("compile_s")
            decode_s = dstats.pop("decode_s")
            stats = {**stats, **dstats}
        else:
            dec, c = compile_once(decode, (params, cache, logits, rng, state), cfg=cfg,
                               method=method, max_new=max_new_tokens, sampling=sampling,
                               stop_ids=stop_ids)
            compile_s += c
            t1 = time.perf_counter()
            out, n, cache, state = _block(dec(params, cache, logits, rng, state))
            decode_s = time.perf_counter() - t1
    out, n = np.asarray(out), np.asarray(n)
    steps = min(int(n.max()) + 1, max_new_tokens) if max_new_tokens else 0
    n_in = sum(len(p) for p in prompts) + sum(len(q) for q in questions or [])
    full = kvcache.full_kv_bytes(cfg, n_in, cache.k.dtype)
    stats = {
        **{k: np.asarray(v).tolist() for k, v in stats.items()},
        "kv_bytes_live": live_after_prefill["kv_bytes_live"],
        "kv_bytes_allocated": live_after_prefill["kv_bytes_allocated"],
        "kv_bytes_full": full,
        "ttft_s": ttft,
        "tpot_s": decode_s / steps if steps else None,
        "compile_s": compile_s,
        "prompt_tokens": [len(p) for p in prompts],
    }
    return Generation([out[i, : n[i]].tolist() for i in range(len(prompts))], cache, stats, state)
