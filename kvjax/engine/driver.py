"""The host-side driver: one generation, from token ids to tokens and measured statistics.

`run` checks the request, pads the batch, prefills with the method's compression, prefills
a context-only question on top, decodes, and reports. Timings exclude compilation, which
is reported on its own (`compile_s`), and the kernel implementation each op actually ran
is recorded (`kernels`).
"""

from __future__ import annotations

from collections.abc import Iterator

import dataclasses
from typing import Any

import jax
import numpy as np

from kvjax import distributed
from kvjax.compression import cache as kvcache
from kvjax.compression.method import Method
from kvjax.config import ModelConfig
from kvjax.engine import shared, steps
from kvjax.engine.clock import Clock
from kvjax.engine.executables import compile_once
from kvjax.engine.inputs import bucket, pad_left
from kvjax.engine.sampling import Sampling
from kvjax.pallas.dispatch import Kernels

# keys of `Generation.stats` that the engine itself measures (the rest come from the method)
ENGINE_STATS = ("kv_bytes_live", "kv_bytes_allocated", "kv_bytes_full", "kv_bytes_live_end",
                "ttft_s", "ttft_own_s", "tpot_s", "steps_run", "compile_s", "prompt_tokens",
                "kernels", "mesh")


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per element, stop token excluded
    cache: kvcache.KVCache
    stats: dict[str, Any]
    state: Any = None  # the method's state after the last step (host bookkeeping if any)


def _limit_name(cfg: ModelConfig) -> str:
    """What `cfg.max_positions` is called in errors."""
    return "max_position_embeddings" if cfg.max_positions == cfg.max_position_embeddings \
        else "yarn length (factor x original_max_position_embeddings)"


def check_tokens(cfg: ModelConfig, prompts, questions, max_new_tokens: int) -> int:
    """Refuse, with the bad value named, token ids no model run can take (empty prompts,
    non-integers, ids outside the vocabulary, more positions than the model has); returns
    the longest prompt + question. Independent of the method: a sweep checks each prompt
    set once, then every method on its lengths (`check_method`)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not len(prompts) or any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    if questions is not None and len(questions) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(questions)} questions")
    for seq in (*prompts, *(questions or ())):
        ids = np.asarray(seq)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError(f"token ids must be a flat sequence of integers, got {ids.dtype} "
                            f"of shape {ids.shape}")
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the model's vocabulary "
                             f"[0, {cfg.vocab_size})")
    longest = max(len(p) + len(q) for p, q in zip(prompts, questions or [[]] * len(prompts)))
    if longest + max_new_tokens > cfg.max_positions:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
            f"{_limit_name(cfg)}={cfg.max_positions}")
    return longest


def check_method(cfg: ModelConfig, lengths, longest: int, method: Method) -> None:
    """Refuse, with the bad value named, a method that cannot run on prompts of these
    lengths (its own `validate`; scores past a sliding window). `longest`: the longest
    prompt + question."""
    for n in sorted(set(lengths)):
        method.validate(n, cfg)
    if not method.positional and cfg.sliding_window is not None and longest > cfg.sliding_window:
        # the model's attention would not see past its window, but the methods' scores
        # (window attention, cumulative sums, merges) see the whole causal prefix
        raise ValueError(
            f"prompt of {longest} tokens exceeds the model's sliding_window="
            f"{cfg.sliding_window}: method {method.name!r} scores the whole causal prefix; "
            "only methods that choose by position ('full', 'streaming_llm') run beyond it")


def check_request(cfg: ModelConfig, prompts, questions, method: Method, max_new_tokens: int):
    """Refuse, with the bad value named, what the model or the method cannot run."""
    longest = check_tokens(cfg, prompts, questions, max_new_tokens)
    check_method(cfg, [len(p) for p in prompts], longest, method)


def _placed(arrays, sharding):
    return arrays if sharding is None else jax.device_put(arrays, sharding)


def _prefill(params, cfg, prompts, method, Tq, max_new, shrink_ok, sharding, clock,
             head_mesh=None, prefilled: shared.Prefilled | None = None):
    """Prefill + compression (and, for append-only methods, dropping the dead slots):
    (logits, cache, state, stats). `head_mesh`: the compression step per device
    (`kvjax.distributed.head_mesh`); `prefilled`: the batch's recorded full prefill, on
    which only the method's compression runs (`kvjax.engine.shared`)."""
    T = bucket(max(len(p) for p in prompts))
    capacity = method.decode_capacity(method.cache_slots(T, cfg), Tq, max_new)
    if prefilled is None:
        tokens, valid = _placed(pad_left(prompts, T, cfg.pad_token_id), sharding)
        pre = clock.compiled(steps.prefill_extent, (params, tokens, valid), cfg=cfg,
                             method=method, capacity=capacity, mesh=head_mesh)
        logits, cache, state, stats, extent = clock.timed(pre, params, tokens, valid)
    else:
        rec = (params, prefilled.q, prefilled.k, prefilled.v, prefilled.valid, prefilled.lse)
        pre = clock.compiled(steps.replay_extent, rec, cfg=cfg, method=method,
                             capacity=capacity)
        cache, state, stats, extent = clock.timed(pre, *rec)
        logits = prefilled.logits
    if shrink_ok and method.static_after_prefill():
        # Methods with per-head or per-layer budgets (AdaKV, PyramidKV, LAVa, CAKE, HeadKV)
        # allocate room for the most any head could keep; decoding over the dead slots
        # would cost as much as the full cache. Drop them (a bucketed count: few shapes).
        slots = bucket(max(int(distributed.to_host(extent)), 1), 1)
        if slots < cache.capacity - Tq - max_new:
            cut, c, _ = compile_once(steps.shrink, (cache,), slots=slots,
                                     capacity=slots + Tq + max_new)  # no kernel op in it
            clock.compile_s += c
            cache = clock.timed(cut, cache)
    return logits, cache, state, stats


def _question(params, cfg, questions, Tq, method, cache, state, sharding, clock):
    """The context-only scenario: the question prefilled on top of the compressed context."""
    qt, qv = _placed(pad_left(questions, Tq, cfg.pad_token_id), sharding)
    ext = clock.compiled(steps.extend, (params, cache, qt, qv, state), cfg=cfg, method=method)
    return clock.timed(ext, params, cache, qt, qv, state)


def _decode(params, cfg, cache, logits, state, method, max_new, sampling, stop_ids, seed, clock,
            first=None):
    """(tokens [B, max_new], counts [B], cache, state, the method's decode stats, the
    steps the loop ran)."""
    rng = jax.random.PRNGKey(seed)
    if method.steps_on_host():
        if first is not None:
            raise ValueError(f"{method.name}: a host-loop decode takes no first-step phase")
        out, n, cache, state, host, c, used, secs, ran = steps.host_decode(
            params, cfg, cache, logits, rng, state, method=method, max_new=max_new,
            sampling=sampling, stop_ids=stop_ids, kernels=clock.config)
        clock.compile_s += c
        clock.kernels |= used
        clock.decode_s += secs
        return out, n, cache, host, method.decode_stats(host, state), ran
    dec = clock.compiled(steps.decode, (params, cache, logits, rng, state), cfg=cfg,
                         method=method, max_new=max_new, sampling=sampling, stop_ids=stop_ids,
                         first=first)
    out, n, cache, state, ran = clock.timed(dec, params, cache, logits, rng, state,
                                            phase="decode_s")
    return out, n, cache, state, method.decode_stats(None, state), int(ran)


def _real_rows(cache: kvcache.KVCache, B: int) -> kvcache.KVCache:
    """The cache of the first B batch elements (the padding a mesh's data axis needed
    dropped)."""
    if cache.k.shape[1] == B:
        return cache
    cut = lambda x: x[:, :B]  # noqa: E731
    return dataclasses.replace(cache, k=cut(cache.k), v=cut(cache.v), pos=cut(cache.pos),
                               valid=cut(cache.valid), next_pos=cache.next_pos[:B])


def _real_stat(v, B: int, padded: int):
    """A method statistic as a list, its rows of padding elements dropped (statistics are
    per element on their leading axis)."""
    a = distributed.to_host(v)
    if padded != B and a.ndim and a.shape[0] == padded:
        a = a[:B]
    return a.tolist()


def _real_decode_stat(v, B: int, padded: int):
    """A decode statistic as the method gave it, its rows of padding elements dropped
    (a per-element list, or an array on its leading axis)."""
    if padded == B:
        return v
    if isinstance(v, (list, tuple)) and len(v) == padded:
        return type(v)(v[:B])
    if getattr(v, "ndim", 0) and v.shape[0] == padded:
        return v[:B]
    return v


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
    mesh=None,
    shrink: bool = True,
    kernels: Kernels = Kernels(),
    prefilled: shared.Prefilled | None = None,
) -> Generation:
    """Compress each prompt (and, context-only, append its question), then decode.

    `shrink`: drop the slots no head uses before decoding, for methods that only append
    while decoding (same tokens, less to attend over); False keeps the prefill's layout.
    `mesh` (a (data, model) `jax.sharding.Mesh`, `kvjax.distributed`): the params placed
    on it (a no-op when loaded so), the batch over `data` -- padded to a multiple of it
    with copies of its last element, whose outputs are dropped -- the KV heads over
    `model`, and the compression step per device where the method allows it
    (`distributed.head_mesh`); the tokens are the single-device ones.
    `batch_sharding` (the older form) places the token arrays only;
    `kernels` picks the kernel implementation of each op (a static part of every program).
    `prefilled` (`kvjax.engine.shared.prefill` of these prompts): the full prefill already
    run; a method that compresses after it (`shared.shares`) runs only its compression,
    with the same result, and `ttft_s` is the recorded prefill's time plus its own
    (`ttft_own_s`). Not with a mesh.
    """
    method = method or Method()
    if prompts:
        method = method.for_prompt(max(len(p) for p in prompts))
    check_request(cfg, prompts, questions, method, max_new_tokens)
    if prefilled is not None:
        if mesh is not None or batch_sharding is not None:
            raise ValueError("prefilled: a shared prefill runs on one device; give no mesh")
        if not shared.shares(method):
            raise ValueError(f"prefilled: method {method.name!r} changes the prefill itself "
                             f"(prefill_kind={method.prefill_kind!r}); run it without one")
        prefilled.check(cfg, prompts)
        kernels = prefilled.kernels
    stop_ids = tuple(cfg.eos_token_ids) if stop_ids is None else tuple(stop_ids)
    Tq = bucket(max(len(q) for q in questions), 1) if questions else 0
    B = len(prompts)
    n_in = sum(len(p) for p in prompts) + sum(len(q) for q in questions or [])
    prompt_tokens = [len(p) for p in prompts]
    head_mesh = None
    if mesh is not None:
        mesh = distributed.as_mesh(mesh, cfg)  # checked; Explicit axes made Auto
        params = distributed.shard_params(params, cfg, mesh)
        batch_sharding = batch_sharding or distributed.batch_sharding(mesh)
        prompts, questions = distributed.pad_batch(prompts, questions, mesh.shape["data"])
        head_mesh = distributed.head_mesh(mesh, method)
    padded = len(prompts)
    clock = Clock(kernels)
    logits, cache, state, stats = _prefill(params, cfg, prompts, method, Tq, max_new_tokens,
                                           shrink, batch_sharding, clock, head_mesh, prefilled)
    own_s = clock.ttft_s  # the compression alone when the prefill was shared
    if prefilled is not None:
        clock.ttft_s += prefilled.prefill_s
        clock.kernels |= prefilled.used
    # a method whose first extension differs (`extension_phases`): the question, else the
    # first decoding step, runs `first`; every later step `later`
    first, later = method.extension_phases() or (None, method)
    if questions:
        logits, cache, state = _question(params, cfg, questions, Tq, first or method, cache,
                                         state, batch_sharding, clock)
        first = None
    # the padding's rows out of the count (the mask alone: no copy of the cache)
    def live_bytes(c):
        return kvcache.kv_bytes(dataclasses.replace(c, valid=c.valid[:, :B]))

    live_after_prefill = live_bytes(cache)
    out, n, decode_stats, ran = np.zeros((padded, 0), np.int32), np.zeros(padded, int), {}, 0
    if max_new_tokens > 0:
        out, n, cache, state, decode_stats, ran = _decode(
            params, cfg, cache, logits, state, later, max_new_tokens, sampling, stop_ids,
            seed, clock, first)
    out, n = distributed.to_host(out)[:B], distributed.to_host(n)[:B]
    steps_run = min(int(n.max()) + 1, max_new_tokens) if max_new_tokens else 0
    stats = {
        **{k: _real_stat(v, B, padded) for k, v in stats.items()},
        **{k: _real_decode_stat(v, B, padded) for k, v in decode_stats.items()},
        "kv_bytes_live": live_after_prefill["kv_bytes_live"],
        "kv_bytes_allocated": live_after_prefill["kv_bytes_allocated"],
        "kv_bytes_full": kvcache.full_kv_bytes(cfg, n_in, cache.k.dtype),
        # after the last token (the generated tokens' KV in): a method that evicts while
        # decoding (d2o_code's first eviction is at its first step) is seen here
        "kv_bytes_live_end": live_bytes(cache)["kv_bytes_live"] if max_new_tokens > 0 else None,
        "ttft_s": clock.ttft_s,
        "ttft_own_s": own_s if prefilled is not None else None,
        # a mean over the steps the loop ran (`steps.decode`'s count): with
        # `Kernels.decode_unroll` k - 1 more than the longest element needed at most, and a
        # mesh's padding rows may run longer than the real ones
        "tpot_s": clock.decode_s / ran if ran else None,
        # the steps the batch's longest element needed
        "steps_run": steps_run,
        "compile_s": clock.compile_s,
        "prompt_tokens": prompt_tokens,
        "kernels": _kernels_used(clock.kernels),
        "mesh": None if mesh is None else {**distributed.describe(mesh),
                                           "compression": "shard_map" if head_mesh else "xla"},
    }
    return Generation([out[i, : n[i]].tolist() for i in range(B)], _real_rows(cache, B), stats,
                      state)


def run_each(params, cfg: ModelConfig, prompts: list[list[int]], runs: list, *,
             questions=None, max_new_tokens: int | list[int] = 32, share: bool = True,
             kernels: Kernels = Kernels(), mesh=None, **kw) -> Iterator[Generation]:
    """The one orchestrator of a shared prefill (the API's `generate_each`, the sweep's
    chunks): yield each run's `Generation` in order, a run being (method, rows of
    `prompts`). Where two or more runs' methods compress after the full prefill
    (`kvjax.engine.shared`; not with a mesh or `share=False`), it runs once on all of
    `prompts` and each of them replays its rows (`Prefilled.take`); the others prefill on
    their own. The tokens are those of separate runs. `questions` (context-only) and a
    per-prompt `max_new_tokens` are taken at each run's rows (its longest answer);
    the other keywords as in `run`."""
    ran = [(m.for_prompt(max(len(prompts[r]) for r in rows)), list(rows)) for m, rows in runs]
    sharing = [shared.shares(m) for m, _ in ran]
    pre = None
    if share and mesh is None and kw.get("batch_sharding") is None and sum(sharing) > 1:
        new = max(max_new_tokens) if isinstance(max_new_tokens, list) else max_new_tokens
        check_tokens(cfg, prompts, questions, new)
        pre = shared.prefill(params, cfg, prompts, kernels)
    everything = list(range(len(prompts)))
    for (m, rows), shares_it in zip(ran, sharing):
        mine = None if pre is None or not shares_it else \
            pre if rows == everything else pre.take(rows)
        new = max(max_new_tokens[r] for r in rows) if isinstance(max_new_tokens, list) \
            else max_new_tokens
        yield run(params, cfg, [prompts[r] for r in rows], m,
                  questions=None if questions is None else [questions[r] for r in rows],
                  max_new_tokens=new, kernels=kernels, mesh=mesh, prefilled=mine, **kw)


def run_methods(params, cfg: ModelConfig, prompts: list[list[int]], methods: list[Method],
                **kw) -> list[Generation]:
    """`run` for each method on the same prompts (`run_each` on all the rows): the full
    prefill runs once for the methods that compress after it. Keywords as in `run` (not
    `mesh`)."""
    if kw.get("mesh") is not None:
        raise ValueError("run_methods: a shared prefill runs on one device; give no mesh "
                         "(or call run per method)")
    rows = list(range(len(prompts)))
    return list(run_each(params, cfg, prompts, [(m, rows) for m in methods], **kw))
