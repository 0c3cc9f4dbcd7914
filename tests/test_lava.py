"""LAVa and CAKE: numpy references over HF eager attentions and value states, cascading
vs non-cascading, invariants, errors, end-to-end."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import engine, methods

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")
F = torch.nn.functional

L, N, W = 4, 96, 8


@pytest.fixture(scope="module")
def pair():
    return hf_models.build_pair("llama_llama3rope_gqa4", seed=3, scale=0.3, layers=L)


def hf_states(model, ids):
    """Eager attentions [L, H, n, n] and value states [L, K, n, D] (v_proj hooks)."""
    vs = []
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: vs.append(o.detach()))
             for layer in model.model.layers]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    for h in hooks:
        h.remove()
    A = np.stack([a[0].float().numpy() for a in out.attentions])
    K = model.config.num_key_value_heads
    V = np.stack([v[0].reshape(len(ids), K, -1).permute(1, 0, 2).float().numpy() for v in vs])
    return A, V


def largest_remainder(weights, total, caps):
    x = weights / weights.sum() * total
    b = np.floor(x).astype(int)
    order = np.argsort(-(x - b), kind="stable")
    b[order[: total - b.sum()]] += 1
    return np.minimum(b, caps)


def ref_keep(s, budgets, heads):
    """Keep masks [L, K, P] for layer budgets (entries over heads)."""
    Lr, K, P = s.shape
    keep = np.zeros_like(s, bool)
    for l in range(Lr):
        if heads == "flat":
            order = np.argsort(-s[l].reshape(-1), kind="stable")[: budgets[l]]
            keep[l].reshape(-1)[order] = True
        else:
            for h in range(K):
                per = budgets[l] // K + (h < budgets[l] % K)
                keep[l, h, np.argsort(-s[l, h], kind="stable")[:per]] = True
    return keep


def ref_lava(A, V, budget, heads="flat", layers="entropy"):
    Lr, H, n, _ = A.shape
    K = V.shape[1]
    G, P = H // K, n - W
    vmax = np.abs(V).sum(-1).max(-1)  # [L, K]
    a = A[:, :, n - W:, :P].mean(2)  # [L, H, P]
    s = a * np.repeat(vmax, G, axis=1)[:, :, None]
    s = F.max_pool1d(torch.tensor(s), 7, 1, 3).numpy().reshape(Lr, K, G, P).max(2)
    p = s / s.sum(axis=(1, 2), keepdims=True)
    e = -(p * np.log(p)).sum(axis=(1, 2)) / (K * P)
    w = e if layers == "entropy" else np.ones(Lr)
    b = largest_remainder(w, (budget - W) * Lr * K, np.full(Lr, K * P))
    return s, e, b, ref_keep(s, b, heads)


def ref_cake(A, K, budget, gamma, g1, g2):
    Lr, H, n, _ = A.shape
    G, P = H // K, n - W
    win = A[:, :, n - W:]  # [L, H, w, n]
    s = win[..., :P].mean(2) + gamma * win[..., :P].var(2)
    s = F.max_pool1d(torch.tensor(s), 7, 1, 3).numpy().reshape(Lr, K, G, P).mean(2)
    Hl = -(np.where(win > 0, win * np.log(np.where(win > 0, win, 1)), 0)).sum(-1).mean((1, 2))
    Vl = win[..., :P].var(2).sum(-1).mean(1)
    pref = Hl ** (1 / g1) * Vl ** (1 / g2)
    b = largest_remainder(pref, (budget - W) * Lr * K, np.full(Lr, K * P))
    return s, pref, b, ref_keep(s, b, "uniform")


@functools.lru_cache(maxsize=None)
def _jitted(m, cfg):
    return jax.jit(lambda p, t, v, ps: engine.compress_prompt(m, p, cfg, t, v, ps))


def kv_prefill(m, cfg, params, ids):
    T = len(ids)
    tok = jnp.asarray([ids])
    valid = jnp.ones((1, T), bool)
    pos = jnp.arange(T)[None]
    _, kv, _, stats = _jitted(m, cfg)(params, tok, valid, pos)
    keep = np.zeros((cfg.num_layers, cfg.num_kv_heads, T - W), bool)
    kpos, kval = np.asarray(kv.pos[:, 0]), np.asarray(kv.valid[:, 0])
    for l in range(cfg.num_layers):
        for h in range(cfg.num_kv_heads):
            p = kpos[l, h][kval[l, h]]
            assert set(range(T - W, T)) <= set(p.tolist()), "window lost"
            keep[l, h, p[p < T - W]] = True
    return keep, {k: np.asarray(v) for k, v in stats.items()}


def ids_for(seed, cfg, n=N):
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, n).tolist()


@pytest.mark.parametrize("heads,layers", [("flat", "entropy"), ("flat", "uniform"),
                                          ("uniform", "entropy")])
def test_lava_matches_numpy(pair, heads, layers):
    model, cfg, params = pair
    ids = ids_for(0, cfg)
    A, V = hf_states(model, ids)
    s, e, b, keep = ref_lava(A, V, 16, heads, layers)
    for cascade in (True, False):
        m = methods.create("lava", budget=16, window=W, heads=heads, layers=layers,
                           cascade=cascade)
        got, stats = kv_prefill(m, cfg, params, ids)
        if layers == "entropy":
            np.testing.assert_allclose(stats["layer_weight"][0], e, rtol=1e-4)
        np.testing.assert_array_equal(got.sum((1, 2)), b)
        np.testing.assert_array_equal(got, keep)


def test_cake_matches_numpy(pair):
    model, cfg, params = pair
    ids = ids_for(1, cfg)
    A, _ = hf_states(model, ids)
    s, pref, b, keep = ref_cake(A, cfg.num_kv_heads, 16, 5.0, 1.0, 2.0)
    for cascade in (True, False):
        m = methods.create("cake", budget=16, window=W, gamma2=2.0, cascade=cascade)
        got, stats = kv_prefill(m, cfg, params, ids)
        np.testing.assert_allclose(stats["layer_weight"][0], pref, rtol=1e-3)
        np.testing.assert_array_equal(got.sum((1, 2)), b)
        np.testing.assert_array_equal(got, keep)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 1000), budget=st.just(16),
       name=st.sampled_from(["lava", "cake"]))
def test_invariants_and_cascade_equals_post(pair, seed, budget, name):
    _, cfg, params = pair
    ids = ids_for(seed, cfg, 64)
    K = cfg.num_kv_heads
    c, sc = kv_prefill(methods.create(name, budget=budget, window=W), cfg, params, ids)
    p, sp = kv_prefill(methods.create(name, budget=budget, window=W, cascade=False),
                       cfg, params, ids)
    np.testing.assert_array_equal(c, p)  # budgets only shrink: same kept sets
    live = sc["layer_budgets"][0]  # [L, K], windows included
    assert live.sum() == budget * L * K
    assert (live >= W).all()
    assert bool(sc["budgets_shrank"][0])
    per_entry = sc["live_kv_bytes"][0] / live.sum()
    bound = (budget * L * K + K * len(ids) + L) * per_entry  # + one layer's prompt + rounding
    assert sc["peak_live_kv_bytes"][0] <= bound
    assert sp["peak_live_kv_bytes"][0] == L * K * len(ids) * per_entry
    assert sc["peak_live_kv_bytes"][0] < sp["peak_live_kv_bytes"][0]


def test_errors(pair):
    _, cfg, params = pair
    ids = ids_for(2, cfg, 64)
    with pytest.raises(ValueError, match="budget=8 cannot hold the window"):
        engine.run(params, cfg, [ids], methods.create("lava", budget=8, window=8), max_new_tokens=1)
    for f in ("gamma1", "gamma2"):
        with pytest.raises(ValueError, match=f"{f}=0.0 is a temperature"):
            engine.run(params, cfg, [ids], methods.create("cake", window=8, budget=16, **{f: 0.0}),
                       max_new_tokens=1)


@pytest.mark.parametrize("name,scenarios", [("lava", 2), ("lava_code", 1), ("cake", 1)])
def test_engine_runs(pair, name, scenarios):
    _, cfg, params = pair
    ids = ids_for(4, cfg, 80)
    q = ids_for(5, cfg, 6)
    m = methods.create(name, budget=16, window=W)
    gens = [engine.run(params, cfg, [ids + q], m, max_new_tokens=4, stop_ids=())]
    if scenarios == 2:  # context-only: question prefilled on top of the compressed cache
        gens.append(engine.run(params, cfg, [ids], m, questions=[q], max_new_tokens=4,
                               stop_ids=()))
    for g in gens:
        assert len(g.tokens[0]) == 4
        assert np.asarray(g.stats["layer_budgets"]).shape == (1, L, cfg.num_kv_heads)
