"""Engine and cache: one compilation per generation, batching, masking, sampling, errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from kvjax import engine, methods
from kvjax.compression import cache as kvcache
from kvjax.config import ModelConfig
from kvjax.methods import Method
from kvjax.models import attention
from kvjax.train import init_params

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0), std=0.3)


_COMPILES: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _COMPILES.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def _prompt(n, seed=0):
    return list(np.random.default_rng(seed).integers(3, CFG.vocab_size, n))


def test_decode_compiles_once_per_generation(params):
    engine.run(params, CFG, [_prompt(30)], max_new_tokens=12, stop_ids=())  # warm
    _COMPILES.clear()
    # same bucket, other tokens and lengths: nothing compiles
    g = engine.run(params, CFG, [_prompt(29, seed=1)], max_new_tokens=12, stop_ids=())
    assert _COMPILES == [] and len(g.tokens[0]) == 12
    # a longer generation: two new programs (prefill into the larger cache, the decode
    # loop), not one per step
    for steps in (40, 77):
        _COMPILES.clear()
        g = engine.run(params, CFG, [_prompt(30)], max_new_tokens=steps, stop_ids=())
        assert len(_COMPILES) == 2 and len(g.tokens[0]) == steps


def test_bucket():
    assert [engine.bucket(n) for n in (1, 16, 17, 20, 21, 33, 100, 1000, 2048, 2049)] == \
        [16, 16, 20, 20, 24, 40, 112, 1024, 2048, 2560]
    for n in range(1, 5000, 37):
        assert n <= engine.bucket(n) <= max(16, 1.25 * n)


def test_batch_equals_single(params):
    """Left padding + position-based masks: a batch gives each element what it gives alone."""
    prompts = [_prompt(n, seed=n) for n in (7, 30, 19)]
    batch = engine.run(params, CFG, prompts, max_new_tokens=10, stop_ids=())
    for p, toks in zip(prompts, batch.tokens):
        assert engine.run(params, CFG, [p], max_new_tokens=10, stop_ids=()).tokens[0] == toks


def test_batch_logits_equal_single(params):
    prompts = [_prompt(n, seed=n) for n in (5, 23)]
    T = engine.bucket(23)
    toks, valid = engine.pad_left(prompts, T, 0)
    logits, cache, _, _ = engine.prefill(params, toks, valid, cfg=CFG, method=Method(), capacity=T + 1)
    for i, p in enumerate(prompts):
        t1, v1 = engine.pad_left([p], engine.bucket(len(p)), 0)
        l1, c1, _, _ = engine.prefill(params, t1, v1, cfg=CFG, method=Method(),
                                      capacity=t1.shape[1] + 1)
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(l1[0]), atol=1e-5)
        assert int(cache.next_pos[i]) == len(p)


def test_stop_tokens(params):
    g = engine.run(params, CFG, [_prompt(12)], max_new_tokens=20, stop_ids=())
    first = g.tokens[0][3]
    g2 = engine.run(params, CFG, [_prompt(12)], max_new_tokens=20, stop_ids=(first,))
    assert g2.tokens[0] == g.tokens[0][: g.tokens[0].index(first)]


def test_sampling(params):
    a = engine.run(params, CFG, [_prompt(12)], max_new_tokens=16, stop_ids=(),
                   sampling=engine.Sampling(1.0, 0.9), seed=3)
    b = engine.run(params, CFG, [_prompt(12)], max_new_tokens=16, stop_ids=(),
                   sampling=engine.Sampling(1.0, 0.9), seed=3)
    c = engine.run(params, CFG, [_prompt(12)], max_new_tokens=16, stop_ids=(),
                   sampling=engine.Sampling(1.0, 0.9), seed=4)
    greedy = engine.run(params, CFG, [_prompt(12)], max_new_tokens=16, stop_ids=())
    tiny_p = engine.run(params, CFG, [_prompt(12)], max_new_tokens=16, stop_ids=(),
                        sampling=engine.Sampling(1.0, 1e-6), seed=5)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert tiny_p.tokens == greedy.tokens  # a nucleus of one token is greedy


def test_top_p_keeps_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(engine.sample(logits, jax.random.PRNGKey(i), engine.Sampling(1.0, 0.7))[0])
            for i in range(200)}
    assert seen == {0, 1}


def test_fully_masked_row_is_not_nan():
    q = jnp.ones((1, 3, 4, 8))
    k = v = jnp.ones((1, 2, 5, 8))
    ok = jnp.zeros((1, 2, 3, 5), bool)
    o, p = attention.attend(q, k, v, ok, return_probs=True)
    assert not np.isnan(np.asarray(o)).any() and not np.isnan(np.asarray(p)).any()
    assert np.all(np.asarray(o) == 0)


def _empty_cache(batch, capacity):
    shape = (CFG.num_layers, batch, CFG.num_kv_heads, capacity)
    return kvcache.KVCache(jnp.zeros((*shape, CFG.head_dim)), jnp.zeros((*shape, CFG.head_dim)),
                           jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool),
                           end=jnp.int32(0), next_pos=jnp.zeros((batch,), jnp.int32))


def test_cache_ops():
    c = _empty_cache(batch=2, capacity=6)
    assert c.k.shape == (2, 2, 2, 6, 8) and not bool(c.valid.any())
    assert kvcache.kv_bytes(c) == {"kv_bytes_live": 0, "kv_bytes_allocated": 2 * 2 * 2 * 6 * 2 * 8 * 4}
    kv = c.kv
    k_new = jnp.ones((2, 2, 3, 8))
    slots = jnp.broadcast_to(jnp.array([1, 2, 4]), (2, 2, 3))
    pos = jnp.array([[10, 11, 12], [0, 1, 2]])
    valid = jnp.array([[True, True, True], [False, True, True]])
    w = kvcache.write(kv, jnp.int32(1), k_new, 2 * k_new, pos, valid, slots)
    k, v, p, val = w.k, w.v, w.pos, w.valid
    assert np.array_equal(np.asarray(val[1, 0, 0]), [0, 1, 1, 0, 1, 0])
    assert np.array_equal(np.asarray(val[1, 1, 0]), [0, 0, 1, 0, 1, 0])
    assert np.array_equal(np.asarray(p[1, 0, 1]), [0, 10, 11, 0, 12, 0])
    assert not bool(val[0].any()) and float(v[1, 0, 0, 2, 0]) == 2.0
    grown = kvcache.pad_capacity(kvcache.KVCache(k, v, p, val, c.end, c.next_pos), 9)
    assert grown.capacity == 9 and kvcache.kv_bytes(grown)["kv_bytes_live"] == 10 * 2 * 8 * 4
    with pytest.raises(ValueError, match="capacity"):
        kvcache.pad_capacity(grown, 4)


def test_decoded_positions_continue(params):
    g = engine.run(params, CFG, [_prompt(9), _prompt(17)], max_new_tokens=5, stop_ids=())
    c = g.cache
    # each element's decoded tokens sit at positions n, n+1, ... whatever the padding
    for b, n in enumerate((9, 17)):
        live = np.asarray(c.pos[0, b, 0])[np.asarray(c.valid[0, b, 0])]
        assert list(live) == list(range(n + 5))


def test_context_only_equals_one_prompt(params):
    """Prefilling the question on top of an uncompressed context = prefilling both at once."""
    ctx, q = _prompt(20), _prompt(6, seed=9)
    joint = engine.run(params, CFG, [ctx + q], max_new_tokens=8, stop_ids=())
    split = engine.run(params, CFG, [ctx], questions=[q], max_new_tokens=8, stop_ids=())
    assert joint.tokens == split.tokens
    assert split.stats["kv_bytes_full"] == joint.stats["kv_bytes_full"]


def test_bad_input(params):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.run(params, CFG, [[]])
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        engine.run(params, CFG, [_prompt(250)], max_new_tokens=10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.run(params, CFG, [_prompt(5)], max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        engine.Sampling(1.0, 0.0)


def test_compression_beyond_a_sliding_window_is_refused(params):
    cfg = dataclasses.replace(CFG, sliding_window=32)
    snap = methods.create("snapkv", budget=16, window=4)
    with pytest.raises(ValueError, match="exceeds the model's sliding_window=32.*'snapkv'"):
        engine.run(params, cfg, [_prompt(40)], snap, max_new_tokens=2)
    engine.run(params, cfg, [_prompt(40)], max_new_tokens=2)  # full runs beyond it
    engine.run(params, cfg, [_prompt(30)], snap, max_new_tokens=2)  # and snapkv inside it
    # streaming_llm chooses by position: beyond the window it keeps the sinks and the
    # most recent entries as anywhere else
    stream = methods.create("streaming_llm", budget=16, n_sink=4)
    c = engine.run(params, cfg, [_prompt(40)], stream, max_new_tokens=2).cache
    live = np.asarray(c.pos[0, 0, 0])[np.asarray(c.valid[0, 0, 0])]
    assert len(live) == 16 and {0, 1, 2, 3} <= set(live) and live.max() >= 39


def test_clear_compiled_drops_the_engines_executables(params):
    engine.clear_compiled()
    engine.run(params, CFG, [_prompt(30)], max_new_tokens=4, stop_ids=())
    held = len(engine.executables._EXECUTABLES)
    assert held == 2  # prefill and decode, kept for the next call
    jax.clear_caches()  # jit's caches only: the AOT executables stay mapped
    assert len(engine.executables._EXECUTABLES) == held
    engine.clear_compiled()
    assert engine.executables._EXECUTABLES == {}
    _COMPILES.clear()
    engine.run(params, CFG, [_prompt(30)], max_new_tokens=4, stop_ids=())
    # prefill and decode compiled afresh (and the small jitted helpers jax dropped)
    assert len(engine.executables._EXECUTABLES) == 2 and len(_COMPILES) >= 2


@pytest.mark.parametrize("name", ["ada_snapkv", "pyramidkv", "lava", "cake"])
@pytest.mark.parametrize("scenario", ["question_aware", "context_only"])
def test_dead_slots_are_dropped_before_decoding(params, name, scenario):
    """Per-head and per-layer budgets leave slots no head uses; decoding without them gives
    the same tokens from the same live entries, over a smaller cache."""
    m = methods.create(name, budget=24, window=8)
    prompts, kw = [_prompt(100, seed=3), _prompt(71, seed=4)], {}
    if scenario == "context_only":
        kw["questions"] = [_prompt(9, seed=5), _prompt(5, seed=6)]
    a = engine.run(params, CFG, prompts, m, max_new_tokens=8, stop_ids=(), **kw)
    b = engine.run(params, CFG, prompts, m, max_new_tokens=8, stop_ids=(), shrink=False, **kw)
    assert a.tokens == b.tokens
    assert a.stats["kv_bytes_live"] == b.stats["kv_bytes_live"]
    assert a.stats["kv_bytes_allocated"] < b.stats["kv_bytes_allocated"]
    for c in (a.cache, b.cache):  # every live entry, with its key, in either layout
        assert kvcache.live_extent(c) <= c.capacity

    def entries(c):
        valid = np.asarray(c.valid)
        idx = np.nonzero(valid)
        order = np.lexsort((np.asarray(c.pos)[idx], idx[2], idx[1], idx[0]))
        return (np.stack(idx[:3])[:, order], np.asarray(c.pos)[idx][order],
                np.asarray(c.k)[idx][order])

    (ia, pa, ka), (ib, pb, kb) = entries(a.cache), entries(b.cache)
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_array_equal(pa, pb)
    # the prompt's keys are moved, not recomputed; the decoded tokens' keys come from
    # softmaxes summed over fewer (dead, zero-weight) slots: fp32 reordering, ~3e-6 seen
    np.testing.assert_allclose(ka, kb, rtol=0, atol=2e-5)


def test_only_append_only_methods_are_shrunk():
    assert methods.create("ada_snapkv").static_after_prefill()
    for name in ("h2o", "streaming_llm", "tova", "d2o", "sliminfer"):
        assert not methods.create(name).static_after_prefill(), name
