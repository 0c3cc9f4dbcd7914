"""The compiled pieces: prefill with compression, a chunk on top of the cache, decoding.

Everything that runs per token is compiled once: the decode loop is a `lax.while_loop`
whose carry holds the donated cache, so a whole generation is one program and no host
sync happens between steps. A method that moves KV between host and device between steps
(`Method.steps_on_host`) gets the same step as one compiled call per token instead, in a
host loop that calls its `between_steps` hook before each (`host_decode`).
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import distributed
from kvjax.compression import cache as kvcache
from kvjax.compression.layer import LayerIO
from kvjax.compression.method import Method
from kvjax.config import ModelConfig
from kvjax.engine import block_pruning, token_selection
from kvjax.engine.executables import compile_once
from kvjax.engine.inputs import positions
from kvjax.engine.layers import extend_layers, extend_per_layer, prefill_layers
from kvjax.engine.sampling import Sampling, sample
from kvjax.models import transformer
from kvjax.pallas.dispatch import Kernels, note


def compress_prompt(method: Method, params, cfg: ModelConfig, tokens_BT, valid_BT, pos_BT,
                    kernels: Kernels = Kernels(), mesh=None):
    """The prompt through the model with the method's compression, by its `prefill_kind`:
    (hidden state of the last prompt token [B, D], the kept kv stacked over layers,
    decode state, the method's stats). `mesh` (`kvjax.distributed.head_mesh`): run the
    per-layer hook per device on its own KV heads (`kvjax.distributed.shard_heads`)."""
    params = transformer.as_stacked(params)  # once, before any loop over layers
    if method.prefill_kind == "token_selection":
        return token_selection.prefill(method, params, cfg, tokens_BT, valid_BT, pos_BT, kernels)
    if method.prefill_kind == "block_pruning":
        return block_pruning.prefill(method, params, cfg, tokens_BT, valid_BT, pos_BT, kernels)

    def hook(io, st):
        kv, aux, st = method.after_layer_prefill(io, st)
        return (kv, aux), st

    state = method.init_state(cfg, *tokens_BT.shape)
    if mesh is not None:
        hook = distributed.shard_heads(hook, mesh, method, cfg, *tokens_BT.shape)
    x, (kv, aux), state = prefill_layers(params, cfg, tokens_BT, valid_BT, pos_BT, hook, state,
                                         kernels)
    kv, state, stats = method.finalize(kv, aux, state)
    return x[:, -1], kv, state, stats


def _prefill(params, tokens_BT, valid_BT, cfg, method, capacity, kernels, mesh=None):
    B = tokens_BT.shape[0]
    pos_BT = positions(valid_BT, jnp.zeros((B,), jnp.int32))
    x_BD, kv, state, stats = compress_prompt(method, params, cfg, tokens_BT, valid_BT, pos_BT,
                                             kernels, mesh)
    return (transformer.unembed(params, cfg, x_BD),
            *_as_cache(method, kv, state, stats, pos_BT, valid_BT, capacity))


def _as_cache(method, kv, state, stats, pos_BT, valid_BT, capacity):
    """(cache, state, stats): the kept kv as the decoding cache of `capacity` slots."""
    cache = kvcache.KVCache.of(kv, end=jnp.asarray(kv.k.shape[3], jnp.int32),
                               next_pos=method.next_position(kv, pos_BT, valid_BT))
    cache = kvcache.pad_capacity(cache, capacity)
    return cache, method.pad_state(state, capacity), stats


@partial(jax.jit, static_argnames=("cfg", "method", "capacity", "kernels", "mesh"))
def prefill(params, tokens_BT, valid_BT, *, cfg: ModelConfig, method: Method, capacity: int,
            kernels: Kernels = Kernels(), mesh=None):
    """Prefill + compression: (last-token logits [B, V], cache, method state, method stats).
    `mesh`: the compression step per device (`compress_prompt`)."""
    return _prefill(params, tokens_BT, valid_BT, cfg, method, capacity, kernels, mesh)


@partial(jax.jit, static_argnames=("cfg", "method", "capacity", "kernels", "mesh"))
def prefill_extent(params, tokens_BT, valid_BT, *, cfg: ModelConfig, method: Method,
                   capacity: int, kernels: Kernels = Kernels(), mesh=None):
    """`prefill`, and the cache's live extent (`kvcache.live_extent`) reduced inside the same
    program, so that the driver reads one integer, not the mask."""
    out = _prefill(params, tokens_BT, valid_BT, cfg, method, capacity, kernels, mesh)
    return (*out, kvcache.live_extent(out[1]))


@partial(jax.jit, static_argnames=("cfg", "kernels"))
def prefill_record(params, tokens_BT, valid_BT, *, cfg: ModelConfig,
                   kernels: Kernels = Kernels()):
    """The plain full prefill, once for every method that compresses after it
    (`kvjax.engine.shared`): (last-token logits [B, V], q [L, B, T, H, Dh], k and v
    [L, B, K, T, Dh], the attention's log-sum-exp [L, B, K, G, T] or None): what their
    hooks read of each layer."""
    B = tokens_BT.shape[0]
    pos_BT = positions(valid_BT, jnp.zeros((B,), jnp.int32))
    x, (q, k, v, lse), _ = prefill_layers(
        params, cfg, tokens_BT, valid_BT, pos_BT,
        lambda io, st: ((io.q, io.k, io.v, io.lse), st), None, kernels)
    return transformer.unembed(params, cfg, x[:, -1]), q, k, v, lse


@partial(jax.jit, static_argnames=("cfg", "method", "capacity", "kernels"))
def replay_extent(params, q_LBTHD, k_LBKTD, v_LBKTD, valid_BT, lse_LBKGT=None, *,
                  cfg: ModelConfig, method: Method, capacity: int,
                  kernels: Kernels = Kernels()):
    """`prefill_extent` without the model: the method's prefill hooks replayed on the
    layers `prefill_record` kept, then `finalize`. (cache, state, stats, extent); the hooks
    see what the fused prefill shows them except the attention output and the hidden
    state (`io.o`, `io.hidden`: None), which no compress-after-prefill method reads."""
    B, T = valid_BT.shape
    pos_BT = positions(valid_BT, jnp.zeros((B,), jnp.int32))
    kpos_BKT = jnp.broadcast_to(pos_BT[:, None], (B, cfg.num_kv_heads, T))
    kvalid_BKT = jnp.broadcast_to(valid_BT[:, None], (B, cfg.num_kv_heads, T))

    def body(st, xs):
        q, k, v, wo, layer, lse = xs
        kv, aux, st = method.after_layer_prefill(
            LayerIO(layer, q, k, v, kpos_BKT, kvalid_BKT, pos_BT, None, None, valid_BT, wo,
                    cfg, kernels, lse=lse), st)
        return st, (kv, aux)

    state = method.init_state(cfg, B, T)
    state, (kv, aux) = jax.lax.scan(body, state, (q_LBTHD, k_LBKTD, v_LBKTD,
                                                  transformer.stacked_layers(params)["o"],
                                                  jnp.arange(cfg.num_layers), lse_LBKGT))
    kv, state, stats = method.finalize(kv, aux, state)
    cache, state, stats = _as_cache(method, kv, state, stats, pos_BT, valid_BT, capacity)
    return cache, state, stats, kvcache.live_extent(cache)


@partial(jax.jit, static_argnames=("slots", "capacity"))
def shrink(cache, *, slots: int, capacity: int):
    return kvcache.shrink(cache, slots, capacity)


def _slots(cache: kvcache.KVCache, state, method, T: int):
    """Where T new entries go: the method's slots [L, B, K, T] (eviction while decoding),
    else the cache's end, the first of T slots appended for every element and head."""
    slots = method.decode_slots(cache, state, T)
    return cache.end if slots is None else slots


def _advanced(kv, cache: kvcache.KVCache, valid_BT) -> kvcache.KVCache:
    """The cache after T new entries: its end past them, the next position past the valid."""
    return kvcache.KVCache.of(kv, end=cache.end + valid_BT.shape[1], next_pos=cache.next_pos
                              + jnp.sum(valid_BT, axis=1, dtype=jnp.int32))


def _extend(params, cache: kvcache.KVCache, tokens_BT, valid_BT, cfg, method, state, kernels):
    T = tokens_BT.shape[1]
    pos_BT = positions(valid_BT, cache.next_pos)
    x, kv, state = extend_layers(params, cfg, params["embed"][tokens_BT], valid_BT, cache.kv,
                                 pos_BT, _slots(cache, state, method, T), method,
                                 state, kernels)
    cache = _advanced(kv, cache, valid_BT)
    state = method.after_layers(cfg, cache, state, cfg.num_layers)
    return transformer.unembed(params, cfg, x[:, -1]), cache, state


@partial(jax.jit, static_argnames=("cfg", "method", "kernels"), donate_argnames=("cache",))
def extend(params, cache, tokens_BT, valid_BT, state=None, *, cfg: ModelConfig, method: Method,
           kernels: Kernels = Kernels()):
    """Prefill a chunk (e.g. the question, context-only scenario) on top of a cache."""
    params = transformer.as_stacked(params)
    return _extend(params, cache, tokens_BT, valid_BT, cfg, method, state, kernels)


def _next_token(logits, rng, done, cfg: ModelConfig, sampling: Sampling, stops):
    """(token [B] (pad once done), live [B], stopped [B], the next rng): one sampling step,
    shared by the compiled and the host loop."""
    rng, sub = jax.random.split(rng)
    tok = jnp.where(done, cfg.pad_token_id, sample(logits, sub, sampling))
    return tok, ~done, jnp.isin(tok, stops), rng


@partial(jax.jit, static_argnames=("cfg", "method", "max_new", "sampling", "stop_ids", "kernels",
                                   "first"), donate_argnames=("cache",))
def decode(params, cache, logits_BV, rng, state=None, *, cfg: ModelConfig, method: Method,
           max_new: int, sampling: Sampling, stop_ids: tuple[int, ...],
           kernels: Kernels = Kernels(), first: Method | None = None):
    """Generate up to `max_new` tokens in one `lax.while_loop`.

    `first`: the method of the first step, run once before the loop (`method` then runs
    the rest; `Method.extension_phases`). Returns tokens [B, max_new] (pad after a stop
    token), the number of tokens each element generated before its stop token, the cache,
    the method state and the steps the loop ran (what the decode time covers: with
    `Kernels.decode_unroll` up to k - 1 dead steps after every element stopped, and the
    padding rows a mesh adds count as elements).
    """
    B = logits_BV.shape[0]
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
    layered = _decode_layout(method, first, kernels, params) == "per_layer"
    if not layered:  # the scan slices stacked weights: stacked once, outside the loop
        params = transformer.as_stacked(params)
    if layered:
        # the cache split once for the whole generation (a copy), and the weights too
        # unless stored per layer (`transformer.store_layers`); the loop then carries
        # per-layer buffers and never slices a stacked array
        layers = transformer.per_layer(params)
        cache = (kvcache.split_layers(cache.kv), cache.end, cache.next_pos)

    def cond(c):
        step, _, _, _, done, _, _, _ = c
        return (step < max_new) & ~jnp.all(done)

    def body(c, m=method):
        step, cache, logits, out, done, n, rng, st = c
        tok, live, stopped, rng = _next_token(logits, rng, done, cfg, sampling, stops)
        out = out.at[:, step].set(tok)
        n = n + (live & ~stopped)
        if layered:
            logits, cache, st = _extend_layered(params, layers, cache, tok[:, None],
                                                live[:, None], cfg, m, st, kernels)
        else:
            logits, cache, st = _extend(params, cache, tok[:, None], live[:, None], cfg, m, st,
                                        kernels)
        return step + 1, cache, logits, out, done | stopped, n, rng, st

    out = jnp.full((B, max_new), cfg.pad_token_id, jnp.int32)
    init = (jnp.int32(0), cache, logits_BV, out, jnp.zeros((B,), bool),
            jnp.zeros((B,), jnp.int32), rng, state)
    if first is not None and max_new > 0:
        init = body(init, first)
    k = _unroll(method, first, kernels)
    if k > 1:
        # k steps an iteration while k more fit; the single-step loop below runs the rest.
        # A step after every element stopped samples pad and appends a dead entry (live
        # is all False), so the tokens and counts are those of k = 1
        def chunk(c):
            for _ in range(k):
                c = body(c)
            return c

        init = jax.lax.while_loop(lambda c: cond(c) & (c[0] + k <= max_new), chunk, init)
    ran, cache, _, out, _, n, _, state = jax.lax.while_loop(cond, body, init)
    if layered:
        kvs, end, next_pos = cache
        cache = kvcache.KVCache.of(kvcache.stack_layers(kvs), end, next_pos)
    return out, n, cache, state, ran


def _decode_layout(method: Method, first: Method | None, kernels: Kernels, params) -> str:
    """The decode loop's layout (`Kernels.decode_layers`): per-layer buffers where every
    hook of the step reads one layer at a time (`Method.layered_hooks`), recorded as used.
    `auto` loops over layers where the weights are stored per layer (the scan would stack
    them: a copy a generation), else as `Kernels.decode_layout` says."""
    if (first is None or first.layered_hooks()) and method.layered_hooks():
        if kernels.decode_layers == "auto" and transformer.layer_storage(params) == "per_layer":
            note("decode_layers", "per_layer")
            return "per_layer"
        return kernels.decode_layout()
    note("decode_layers", "scan")
    return "scan"


def _unroll(method: Method, first: Method | None, kernels: Kernels) -> int:
    """`Kernels.decode_unroll` where the step is plain (a hook method's state and
    statistics would see the steps run after every element stopped), else 1."""
    k = kernels.decode_unroll if first is None and method.plain_decode() else 1
    if k > 1:
        note("decode_unroll", str(k))
    return k


def _extend_layered(params, layers, cache, tokens_BT, valid_BT, cfg: ModelConfig,
                    method: Method, state, kernels: Kernels):
    """`_extend` over per-layer buffers (`Method.layered_hooks`): cache = (kvs, end,
    next_pos). The method's slots are asked a layer at a time, of a one-layer view of
    that layer's `valid` (nothing stacked); `after_step` gets no cache."""
    kvs, end, next_pos = cache
    T = tokens_BT.shape[1]
    pos_BT = positions(valid_BT, next_pos)

    def slots(kv):  # [B, K, T], or None: appended at `end`
        view = kvcache.LayerKV(None, None, None, kv.valid[None])
        s = method.decode_slots(kvcache.KVCache.of(view, end, next_pos), state, T)
        return None if s is None else s[0]

    per_layer = [slots(kv) for kv in kvs]
    x, kvs, state = extend_per_layer(layers, cfg, params["embed"][tokens_BT], valid_BT, kvs,
                                     pos_BT, end if per_layer[0] is None else tuple(per_layer),
                                     kernels, method, state)
    cache = (kvs, end + T, next_pos + jnp.sum(valid_BT, axis=1, dtype=jnp.int32))
    state = method.after_layers(cfg, None, state, cfg.num_layers)
    return transformer.unembed(params, cfg, x[:, -1]), cache, state


@partial(jax.jit, static_argnames=("cfg", "method", "span", "sampling", "stop_ids", "kernels"),
         donate_argnames=("cache",))
def decode_segment(params, cache, carry, state=None, *, cfg: ModelConfig, method: Method,
                   span: tuple[int, int], sampling: Sampling, stop_ids: tuple[int, ...],
                   kernels: Kernels = Kernels()):
    """The layers [a, b) of one decode step, for methods that work on the host between
    parts of a step (`Method.decode_segments`). The first segment samples the token (from
    `carry`'s logits, rng and done); the last writes the step's outputs (token, stopped,
    logits, rng). Returns (carry, cache, state)."""
    a, b = span
    note("decode_layers", "scan")
    if a == 0:
        stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
        tok, live, stopped, rng = _next_token(carry["logits"], carry["rng"], carry["done"], cfg,
                                              sampling, stops)
        valid = live[:, None]
        carry = dict(x=params["embed"][tok[:, None]], tok=tok, valid=valid, stopped=stopped,
                     rng=rng, pos=positions(valid, cache.next_pos),
                     slots=_slots(cache, state, method, 1))
    x, kv, state = extend_layers(params, cfg, carry["x"], carry["valid"], cache.kv, carry["pos"],
                                 carry["slots"], method, state, kernels, span)
    cache = kvcache.KVCache.of(kv, cache.end, cache.next_pos)
    if b < cfg.num_layers:
        return {**carry, "x": x}, cache, method.after_layers(cfg, cache, state, b)
    cache = _advanced(kv, cache, carry["valid"])
    state = method.after_layers(cfg, cache, state, b)
    return (dict(tok=carry["tok"], stopped=carry["stopped"], rng=carry["rng"],
                 logits=transformer.unembed(params, cfg, x[:, -1])), cache, state)


def host_decode(params, cfg: ModelConfig, cache, logits_BV, rng, state, *, method: Method,
                max_new: int, sampling: Sampling, stop_ids: tuple[int, ...], kernels: Kernels):
    """`decode` as a host loop of compiled steps: the method's `between_steps` before each,
    and, where it splits the step (`decode_segments`), `between_segments` inside it.

    Returns (tokens [B, max_new], counts [B], cache, state, host bookkeeping, compile
    seconds, kernel ops used, decode seconds, steps run)."""
    B = logits_BV.shape[0]
    # the compiled segments slice stacked weights: stacked once here (a copy of a per-layer
    # model's weights for the generation), not in every step's program
    params = transformer.as_stacked(params)
    t0 = time.perf_counter()
    host, state, compile_s = method.init_host(cfg, cache, state, compile_once)
    setup_s = time.perf_counter() - t0 - compile_s
    bounds = (0, *method.decode_segments(cfg), cfg.num_layers)
    spans = tuple(zip(bounds[:-1], bounds[1:]))
    static = dict(cfg=cfg, method=method, sampling=sampling, stop_ids=stop_ids, kernels=kernels)
    used: set = set()
    # each segment's program, compiled at its first call with a state of those shapes: the
    # cache's are the same at every step (a fixed capacity); a method's state may take a
    # few shapes (SlimInfer's revived rows, bucketed), each compiled once
    segments: dict = {}
    out = np.full((B, max_new), cfg.pad_token_id, np.int32)
    n = np.zeros(B, np.int64)
    done = np.zeros(B, bool)
    t0 = time.perf_counter()
    ran = 0
    for t in range(max_new):
        ran = t + 1
        cache, state = method.between_steps(host, cache, state, done)
        carry = dict(logits=logits_BV, rng=rng, done=jnp.asarray(done))
        for i, span in enumerate(spans):
            if i:
                cache, state = method.between_segments(host, i - 1, cache, state, done)
            key = (i, tuple(getattr(x, "shape", None) for x in jax.tree.leaves(state)))
            if key not in segments:
                segments[key], c, u = compile_once(decode_segment, (params, cache, carry, state),
                                                   span=span, **static)
                compile_s, used = compile_s + c, used | u
                t0 += c  # compilation is reported apart from the decode time
            carry, cache, state = segments[key](params, cache, carry, state)
        logits_BV, rng = carry["logits"], carry["rng"]
        tok, stopped = np.asarray(carry["tok"]), np.asarray(carry["stopped"])
        out[:, t] = tok
        n += ~done & ~stopped
        done = done | stopped
        if done.all():
            break
    jax.block_until_ready(cache)
    return out, n, cache, state, host, compile_s, used, time.perf_counter() - t0 + setup_s, ran
