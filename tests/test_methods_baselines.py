"""SnapKV, PyramidKV, Ada-SnapKV, Ada-PyramidKV, StreamingLLM, TOVA, H2O and observed
attention: selection invariants (hypothesis), decode-time eviction, both scenarios end to
end, `budget = context` == `full`, and the errors bad inputs get."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax import engine, methods
from kvjax.cli import args as run_args, sweep as run_sweep
from kvjax.compression import budgets
from kvjax.compression import selection as select
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.models.checkpoint import save_hf
from kvjax.train import init_params

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))
BASELINES = ["snapkv", "pyramidkv", "ada_snapkv", "ada_pyramidkv", "streaming_llm", "tova",
             "h2o", "observed_attention"]
DECODE_EVICTING = ["h2o", "tova", "streaming_llm"]


def make(name, budget, window=4, **kw):
    fields = {f.name for f in dataclasses.fields(methods.get(name))}
    extra = {"window": window, "kernel": 5} if "kernel" in fields else {}
    if name == "observed_attention":
        extra = {"window": window}
    return methods.create(name, budget=budget, **{**extra, **kw})


def forced_positions(m, n):
    """Positions every head of an n-token prompt must keep."""
    if m.name == "streaming_llm":
        return set(range(m.n_sink)) | {n - 1}
    if m.name == "h2o":
        return set(range(n - m.recent, n))
    if m.name == "tova":
        return {n - 1}
    return set(range(n - m.window, n))


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0), std=0.3)


# ---- selection invariants on one layer (hypothesis) -----------------------------------------


def _io(seed, B, T, pads, layer=0):
    rng = np.random.default_rng(seed)
    K, H, D = CFG.num_kv_heads, CFG.num_heads, CFG.head_dim
    valid = np.ones((B, T), bool)
    for b, p in enumerate(pads):
        valid[b, :p] = False
    pos = np.cumsum(valid, 1) - 1
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * 2)
    return LayerIO(jnp.int32(layer), f(B, T, H, D), f(B, K, T, D), f(B, K, T, D),
                   jnp.asarray(np.broadcast_to(pos[:, None], (B, K, T))),
                   jnp.asarray(np.broadcast_to(valid[:, None], (B, K, T))),
                   jnp.asarray(pos), f(B, T, H, D), f(B, T, CFG.hidden_size), jnp.asarray(valid),
                   None, CFG)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(BASELINES), seed=st.integers(0, 10_000),
       pads=st.sampled_from([(0,), (0, 9), (5, 0)]), window=st.integers(1, 6),
       layer=st.integers(0, CFG.num_layers - 1), data=st.data())
def test_prefill_selection_invariants(name, seed, pads, window, layer, data):
    T = 40
    n = [T - p for p in pads]
    kw = {"beta": 2} if "pyramid" in name else {}  # beta 2: the pyramid regime, not uniform
    probe = make(name, 2 * window + 8, window, **kw)
    budget = data.draw(st.integers(max(probe.forced, window) + 1, min(n)))
    m = make(name, budget, window, **kw)
    io = _io(seed, len(pads), T, pads, layer)
    state = m.init_state(CFG, len(pads), T)
    # jitted (the engine's way); jit == eager is checked on the selection helpers below
    kv = jax.jit(lambda io, s: m.after_layer_prefill(io, s)[0])(io, state)
    k, v, pos, valid = kv.k, kv.v, kv.pos, kv.valid
    k, pos, valid = np.asarray(k), np.asarray(pos), np.asarray(valid)
    S = pos.shape[-1]
    assert S == m.cache_slots(T, CFG)
    for b, nb in enumerate(n):
        lb = budget
        if "pyramid" in name:  # this element's schedule (its own length), this layer
            lb = int(budgets.pyramid(budget, nb, CFG.num_layers, window, m.beta)[layer])
        counts = valid[b].sum(-1)
        if name.startswith("ada"):
            assert counts.sum() == CFG.num_kv_heads * lb  # flattened: the layer's total
        else:
            assert np.all(counts == lb)  # uniform per head
        for h in range(CFG.num_kv_heads):
            live = valid[b, h]
            assert live[: counts[h]].all() and not live[counts[h]:].any()  # kept first
            p = pos[b, h, live]
            assert np.all(np.diff(p) > 0) and p.min() >= 0  # unique, ascending, no padding
            assert forced_positions(m, nb) <= set(p.tolist())  # window / sinks live
            # the kept rows are the prompt's rows at those positions
            np.testing.assert_array_equal(k[b, h, live],
                                          np.asarray(io.k)[b, h, pads[b] + p])
        if name == "tova":  # one score per layer: every KV head keeps the same positions
            assert all(set(pos[b, h, valid[b, h]]) == set(pos[b, 0, valid[b, 0]])
                       for h in range(CFG.num_kv_heads))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.sampled_from([5, 17, 30]), S=st.sampled_from([1, 4, 30]),
       data=st.data())
def test_slots_from_scores(seed, n, S, data):
    rng = np.random.default_rng(seed)
    s = rng.random((2, 3, n)).astype(np.float32)
    s[0, :, : n // 3] = -np.inf  # padding
    count = np.array(data.draw(st.lists(st.integers(0, min(S, n - n // 3)), min_size=6,
                                        max_size=6))).reshape(2, 3)
    s[:, :, -1] = np.inf  # forced
    count = np.maximum(count, 1)
    f = lambda s, c: select.slots_from_scores(s, c, S)
    idx, live = map(np.asarray, f(jnp.asarray(s), jnp.asarray(count)))
    idx_j, live_j = map(np.asarray, jax.jit(f)(jnp.asarray(s), jnp.asarray(count)))
    np.testing.assert_array_equal(live, live_j)
    np.testing.assert_array_equal(idx[live], idx_j[live_j])
    for b in range(2):
        for h in range(3):
            kept = idx[b, h][live[b, h]]
            assert len(kept) == min(count[b, h], S, n)
            assert np.all(np.diff(kept) > 0) and kept[-1] == n - 1
            assert np.isfinite(s[b, h, kept[:-1]]).all()  # never padding
            order = np.argsort(-s[b, h], kind="stable")  # ties: lower index first
            assert set(kept.tolist()) == set(order[: len(kept)].tolist())


def test_slots_from_mask_and_evict_lowest():
    keep = jnp.asarray(np.array([[[1, 0, 1, 1, 0, 0, 1]]], bool))
    idx, live = select.slots_from_mask(keep, 5)
    assert np.asarray(idx)[0, 0, :4].tolist() == [0, 2, 3, 6] and np.asarray(live).sum() == 4
    s = jnp.asarray([[[0.5, 0.1, 0.3, 0.2, 0.9]]])
    ok = jnp.asarray([[[True, False, True, True, True]]])
    for excess, want in ((0, []), (1, [3]), (2, [2, 3])):
        gone = select.evict_lowest(s, ok, jnp.array([[excess]]), 2)
        assert np.flatnonzero(np.asarray(gone)[0, 0]).tolist() == want
    gone = select.evict_lowest(s, ok, jnp.array([[1]]), 1)
    assert np.flatnonzero(np.asarray(gone)[0, 0]).tolist() == [3]


# ---- batching, budget = context, decode-time eviction ---------------------------------------


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, n).tolist()


def _kept(cache):
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
    return [[[sorted(pos[l, b, h][valid[l, b, h]].tolist()) for h in range(pos.shape[2])]
             for b in range(pos.shape[1])] for l in range(pos.shape[0])]


@pytest.mark.parametrize("name", [pytest.param("snapkv", marks=pytest.mark.slow), "pyramidkv",
                                  "ada_snapkv"])
def test_batch_equals_single(params, name):
    """Left padding is invisible: each element keeps what it keeps alone (PyramidKV's
    budgets follow each element's own length)."""
    m = make(name, 20, 4, beta=2) if "pyramid" in name else make(name, 20, 4)
    prompts = [_prompt(60, 1), _prompt(37, 2)]
    T = engine.bucket(60)
    tok, val = engine.pad_left(prompts, T, CFG.pad_token_id)
    cap = m.cache_slots(T, CFG)
    lg, cache, _, _ = engine.prefill(params, tok, val, cfg=CFG, method=m, capacity=cap)
    for b, p in enumerate(prompts):
        t1, v1 = engine.pad_left([p], len(p), CFG.pad_token_id)
        lg1, c1, _, _ = engine.prefill(params, t1, v1, cfg=CFG, method=m,
                                       capacity=m.cache_slots(len(p), CFG))
        assert [layer[b] for layer in _kept(cache)] == [layer[0] for layer in _kept(c1)]
        np.testing.assert_allclose(np.asarray(lg[b]), np.asarray(lg1[0]), atol=2e-5)


def _fast(names, fast):
    """Parameters where only `fast` run by default; the rest are marked slow (CI time)."""
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _fast(BASELINES, ("snapkv", "ada_pyramidkv", "h2o",
                                                   "observed_attention", "tova")))
def test_budget_equal_context_is_full(params, name):
    """A budget of the whole prompt keeps every entry: kept sets and prefill logits equal
    `full`'s exactly."""
    p = _prompt(48, 3)
    tok, val = engine.pad_left([p], 48, CFG.pad_token_id)
    full = methods.Method()
    lf, cf, _, _ = engine.prefill(params, tok, val, cfg=CFG, method=full, capacity=48)
    m = make(name, 48, 4)
    lm, cm, _, _ = engine.prefill(params, tok, val, cfg=CFG, method=m,
                                  capacity=m.cache_slots(48, CFG))
    assert _kept(cm) == _kept(cf)
    np.testing.assert_array_equal(np.asarray(lm), np.asarray(lf))


@pytest.mark.parametrize("name", DECODE_EVICTING)
@pytest.mark.parametrize("scenario", _fast(["question_aware", "context_only"], ("context_only",)))
def test_decode_eviction_keeps_budget_every_step(params, name, scenario):
    """Step by step through `engine.extend`: exactly `budget` live entries per (layer,
    element, head) after every step (and after the question chunk); the jitted
    while_loop gives the same tokens and the same final kept sets."""
    budget, steps = 20, 6
    m = make(name, budget)
    prompts = [_prompt(50, 4), _prompt(41, 5)]
    questions = [_prompt(5, 6), _prompt(3, 7)] if scenario == "context_only" else None
    T = engine.bucket(50)
    Tq = engine.bucket(5, 1) if questions else 0
    cap = m.decode_capacity(m.cache_slots(T, CFG), Tq, steps)
    assert cap == budget + max(Tq, 1)  # fixed: does not grow with max_new
    tok, val = engine.pad_left(prompts, T, CFG.pad_token_id)
    logits, cache, state, _ = engine.prefill(params, tok, val, cfg=CFG, method=m, capacity=cap)
    live = lambda c: np.asarray(c.valid).sum(-1)
    assert np.all(live(cache) == budget)
    if questions:
        qt, qv = engine.pad_left(questions, Tq, CFG.pad_token_id)
        logits, cache, state = engine.extend(params, cache, qt, qv, state, cfg=CFG, method=m)
        assert np.all(live(cache) == budget)
    start = jax.tree.map(jnp.copy, (cache, state, logits))  # extend donates the cache
    toks = []
    for _ in range(steps):
        t = jnp.argmax(logits, -1).astype(jnp.int32)
        toks.append(np.asarray(t))
        logits, cache, state = engine.extend(params, cache, t[:, None], jnp.ones((2, 1), bool),
                                             state, cfg=CFG, method=m)
        assert np.all(live(cache) == budget)
        pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
        top = np.where(valid, pos, -1).max(-1)
        assert np.all(top == np.asarray(cache.next_pos)[None, :, None] - 1)  # newest live
        if name == "streaming_llm":  # sinks + the most recent budget - 4, exactly
            for l, b, h in np.ndindex(*pos.shape[:3]):
                want = set(range(4)) | set(range(top[l, b, h] - budget + 5, top[l, b, h] + 1))
                assert set(pos[l, b, h][valid[l, b, h]].tolist()) == want
        if name == "tova":
            assert np.all([_kept(cache)[l][b][0] == _kept(cache)[l][b][1]
                           for l in range(3) for b in range(2)])
        if name == "h2o":  # the recent window is live, scores of dead slots are zero
            assert np.all(np.asarray(state)[~valid] == 0)
    cache0, state0, logits0 = start
    out, n, cache_loop, _, ran = engine.decode(params, cache0, logits0, jax.random.PRNGKey(0),
                                               state0, cfg=CFG, method=m, max_new=steps,
                                               sampling=engine.Sampling(), stop_ids=())
    assert int(ran) == steps
    assert np.asarray(out).T.tolist() == [t.tolist() for t in toks]
    assert _kept(cache_loop) == _kept(cache)


# ---- end to end through kvjax.generate, both scenarios ---------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory, params):
    d = tmp_path_factory.mktemp("tiny")
    save_hf(d, CFG, params)
    return kvjax.load(d)


@pytest.mark.parametrize("name", _fast(BASELINES, ("snapkv", "ada_pyramidkv", "h2o")))
def test_generate_both_scenarios(model, name):
    budget = 24
    m = make(name, budget, 8)
    ctx = [_prompt(70, 8), _prompt(57, 9)]
    q = [_prompt(4, 10), _prompt(6, 11)]
    for scenario in ("question_aware", "context_only"):
        if scenario == "question_aware":
            r = kvjax.generate(model, [c + x for c, x in zip(ctx, q)], m, max_new_tokens=5,
                               stop_ids=())
        else:
            r = kvjax.generate(model, ctx, m, question=q, max_new_tokens=5, stop_ids=())
        assert [len(t) for t in r.tokens] == [5, 5]
        lb = np.asarray(r.stats["layer_budgets"])
        assert lb.shape == (2, CFG.num_layers, CFG.num_kv_heads)
        if name.startswith("ada"):
            assert np.all(lb.sum(-1) == CFG.num_kv_heads * lb.mean(-1))
        assert r.stats["kv_bytes_live"] < 0.6 * r.stats["kv_bytes_full"], (name, scenario)


def test_compress_api_reports_layer_budgets(model):
    cache, stats = kvjax.compress(model, _prompt(64, 12), make("pyramidkv", 24, 2, beta=2))
    lb = np.asarray(stats["layer_budgets"])[0, :, 0]
    assert list(lb) == sorted(lb, reverse=True) and len(set(lb)) > 1
    assert np.asarray(cache.valid).sum() == stats["kv_bytes_live"] // (
        2 * CFG.head_dim * 4)


# ---- errors ------------------------------------------------------------------------------------


def test_bad_inputs(params):
    with pytest.raises(ValueError, match="unknown method 'snap'.*snapkv"):
        methods.create("snap")
    with pytest.raises(ValueError, match="no parameter"):
        methods.create("snapkv", windw=8)
    p = [_prompt(40)]
    cases = [
        (make("snapkv", 8, 8), r"budget=8 must be larger than the 8 .*observation window"),
        (make("snapkv", 41, 8), r"budget=41 exceeds the prompt length 40"),
        (make("streaming_llm", 4, n_sink=4), r"budget=4 .* attention sinks"),
        (make("h2o", 20, recent_ratio=1.0), r"recent_ratio=1.0 outside"),
        (make("pyramidkv", 20, beta=0.5), r"beta=0.5 must be >= 1"),
        (make("ada_snapkv", 20, alpha=1.5), r"alpha=1.5 outside \[0, 1\]"),
        (make("ada_snapkv", 20, safeguard="x"), r"safeguard='x'; allowed"),
        (make("snapkv", 20, pooling="mean"), r"pooling='mean'; allowed"),
        (make("snapkv", 20, kernel=4), r"kernel=4 must be a positive odd"),
    ]
    for m, msg in cases:
        with pytest.raises(ValueError, match=msg):
            engine.run(params, CFG, p, m, max_new_tokens=1)
    for bad in ("1", "1.5", "-0.2"):
        with pytest.raises(SystemExit):
            run_args.parse_args(["--ratio", bad])
    assert run_sweep.make_method("snapkv", None, 0.75, 2048, {}).budget == 512  # kvpress: n(1-r)
    assert run_sweep.make_method("snapkv", 64, None, 2048, {}).budget == 64
