"""D2O (`d2o`, `d2o_code`): a plain-numpy reference of the prefill (HF eager attentions and
HF key/value states of the same weights) and of one decode step (the hook on random cache
contents and attention), invariants, the merge=False == H2O equivalence, end-to-end runs.

Reference tolerance: fp32, rtol = atol = 2e-5 on keys/values (HF and kvjax projections
differ by fp32 rounding: seen up to 3e-5 absolute on values of magnitude ~4, 7e-6 relative).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import engine, methods
from kvjax.methods.d2o import merge
from kvjax.models.checkpoint import load_hf
from kvjax.models.transformer import LayerIO

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")

L = 4
N = 48
DIFFS: list[float] = []


@pytest.fixture(scope="module")
def pair():
    model = hf_models.build("llama_llama3rope_gqa4", seed=1, scale=0.3, layers=L)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        cfg, params = load_hf(d)
    return model, cfg, params


def _cos(a, b):
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-6)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-6)
    return a @ b.T


def ref_merge(k, v, keep, gone, tau, kind):
    """Eq. 11-12 (softmax) / the code's mean merge, written out entry by entry."""
    k, v = k.copy(), v.copy()
    kept_idx = np.flatnonzero(keep)
    into: dict[int, list] = {}
    merged = []
    for i in np.flatnonzero(gone):
        u = _cos(k[i:i + 1], k[kept_idx])[0]
        j = kept_idx[int(np.argmax(u))]
        if u.max() >= tau:
            into.setdefault(j, []).append((i, u.max()))
            merged.append(i)
    k0, v0 = k.copy(), v.copy()
    for j, lst in into.items():
        if kind == "softmax":
            w = np.array([math.exp(u) for _, u in lst])
            den = math.e + w.sum()
            k[j] = (math.e * k0[j] + sum(wi * k0[i] for wi, (i, _) in zip(w, lst))) / den
            v[j] = (math.e * v0[j] + sum(wi * v0[i] for wi, (i, _) in zip(w, lst))) / den
        else:
            den = 1 + len(lst)
            k[j] = (k0[j] + sum(u * k0[i] for i, u in lst)) / den
            v[j] = (v0[j] + sum(u * v0[i] for i, u in lst)) / den
    return k, v, merged


def ref_prefill(m, attn, K_, V_, n_layers):
    """attn [L, H, n, n], K_/V_ [L, Kh, n, D] -> per layer, per head: (pos, k, v) kept, S_l."""
    Lh, H, n, _ = attn.shape
    Kh = K_.shape[1]
    G = H // Kh
    fv = []
    for l in range(Lh):
        cs = attn[l].sum(1)  # [H, n] column sums over queries
        if m.variance == "minmax":
            cs = (cs - cs.min(1, keepdims=True)) / (cs.max(1, keepdims=True) - cs.min(1, keepdims=True))
        fv.append(np.mean(cs.var(1)))
    fv = np.array(fv)
    S = m.kept_slots(n)
    if m.layer_budgets:
        a = Lh * np.exp(-fv - np.max(-fv)) / np.exp(-fv - np.max(-fv)).sum()
        s = np.clip(a * m.budget / n, 0.01, 1) * n if m.alpha_clamp else a * m.budget
    else:
        s = np.full(Lh, float(m.budget))
    s = np.clip(np.floor(s).astype(int), m.sinks + 2, n)
    if m.full_edge_layers:
        s[[0, 1, Lh - 1]] = n
    s = np.minimum(s, S)
    out = []
    for l in range(Lh):
        M = max(1, int(np.floor((s[l] - m.sinks) * m.recent_ratio)))
        heads = []
        for h in range(Kh):
            acc = attn[l, h * G:(h + 1) * G].sum(1).mean(0)  # GQA mean of column sums
            forced = (np.arange(n) < m.sinks) | (np.arange(n) > n - 1 - M)
            sc = np.where(forced, np.inf, acc)
            keep = np.zeros(n, bool)
            keep[np.argsort(-sc, kind="stable")[: s[l]]] = True
            gone = ~keep
            kk, vv = K_[l, h], V_[l, h]
            tau = np.mean([_cos(kk[i:i + 1], kk[keep])[0].max() for i in np.flatnonzero(gone)]) \
                if gone.any() else 1.0
            if m.merge and m.prefill_merge:
                kk, vv, _ = ref_merge(kk, vv, keep, gone, tau, m.merge_kind)
            heads.append((np.flatnonzero(keep), kk[keep], vv[keep], tau))
        out.append(heads)
    return out, s


def _hf(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, use_cache=True)
    attn = np.stack([a[0].float().numpy() for a in out.attentions])
    pkv = out.past_key_values
    ks = np.stack([pkv.layers[l].keys[0].numpy() for l in range(len(attn))])
    vs = np.stack([pkv.layers[l].values[0].numpy() for l in range(len(attn))])
    return attn, ks, vs


@pytest.mark.parametrize("name,budget", [("d2o", 12), ("d2o_code", 20)])
def test_reference_prefill(pair, name, budget):
    model, cfg, params = pair
    m = methods.create(name, budget=budget)
    for seed in range(2):
        ids = np.random.default_rng(seed).integers(3, 97, N).tolist()
        attn, ks, vs = _hf(model, ids)
        ref, s = ref_prefill(m, attn, ks, vs, L)
        _, cache, state, stats = engine.prefill(
            params, jnp.array([ids]), jnp.ones((1, N), bool), cfg=cfg, method=m,
            capacity=m.kept_slots(N) + 1)
        assert list(np.asarray(stats["d2o_layer_budgets"])[0]) == list(s)
        for l in range(L):
            for h in range(cfg.num_kv_heads):
                val = np.asarray(cache.valid[l, 0, h])
                pos, k, tau = ref[l][h][0], ref[l][h][1], ref[l][h][3]
                np.testing.assert_array_equal(np.asarray(cache.pos[l, 0, h])[val], pos)
                np.testing.assert_allclose(np.asarray(cache.k[l, 0, h])[val], k, rtol=2e-5, atol=2e-5)
                DIFFS.append(float(np.abs(np.asarray(cache.v[l, 0, h])[val] - ref[l][h][2]).max()))
                np.testing.assert_allclose(np.asarray(cache.v[l, 0, h])[val], ref[l][h][2],
                                           rtol=2e-5, atol=2e-5)
                np.testing.assert_allclose(float(state["tau"][l, 0, h]), tau, atol=1e-5)
    print(f"\n{name}: prefill reference max |dv| = {max(DIFFS):.2e}")


def ref_decode_step(m, k, v, pos, valid, acc, add, tau, s_l, m_l):
    """One decode step of one (layer, head) in numpy: score update, eviction, EMA, merge."""
    acc = acc + add
    live = valid.sum()
    k, v, valid = k.copy(), v.copy(), valid.copy()
    merged = discarded = 0
    if live > s_l:
        top = pos[valid].max()
        ev = valid & (pos >= m.sinks) & (pos <= top - m_l)
        i = int(np.argmin(np.where(ev, acc, np.inf)))
        keep = valid.copy()
        keep[i] = False
        gone = ~keep & valid
        umax = _cos(k[i:i + 1], k[keep])[0].max()
        tau = m.beta * umax + (1 - m.beta) * tau
        if m.merge:
            k, v, mg = ref_merge(k, v, keep, gone, tau, m.merge_kind)
        else:
            mg = []
        merged, discarded = len(mg), 1 - len(mg)
        valid = keep
        acc = np.where(gone, 0.0, acc)
    return k, v, valid, acc, tau, merged, discarded


@pytest.mark.parametrize("name", ["d2o", "d2o_code"])
def test_reference_decode_steps(name):
    """N consecutive decode steps of the hook on random keys/attention vs the numpy step."""
    m = methods.create(name, budget=8)
    rng = np.random.default_rng(0)
    B, K, G, C, D = 1, 2, 2, 12, 8
    k = rng.normal(size=(B, K, C, D)).astype(np.float32)
    k[..., 1::2, :] += k[..., 0:1, :] * 2  # some near-duplicates so both branches occur
    v = rng.normal(size=(B, K, C, D)).astype(np.float32)
    pos = np.broadcast_to(np.arange(C), (B, K, C)).copy()
    valid = np.ones((B, K, C), bool)
    valid[..., -1] = False
    st_ = {"acc": jnp.asarray(rng.random((1, B, K, C)).astype(np.float32)),
           "tau": jnp.full((1, B, K), 0.5), "budget": jnp.array([[10]]),
           "recent": jnp.array([[2]]), "merges": jnp.zeros((1, B), jnp.int32),
           "discards": jnp.zeros((1, B), jnp.int32)}
    ref = {h: (k[0, h], v[0, h], valid[0, h], np.asarray(st_["acc"][0, 0, h]), 0.5)
           for h in range(K)}
    hook = jax.jit(m.decode_layer)
    seen = set()
    for step in range(6):
        # the new token lands in the dead slot with the next position
        slot = np.argmin(valid, axis=-1)
        for h in range(K):
            j = slot[0, h]
            k[0, h, j], v[0, h, j] = rng.normal(size=D), rng.normal(size=D)
            pos[0, h, j] = C + step
            valid[0, h, j] = True
        probs = rng.random((B, K, G, 1, C)).astype(np.float32) * valid[:, :, None, None]
        io = LayerIO(jnp.int32(0), jnp.zeros((B, 1, K * G, D)), jnp.asarray(k),
                     jnp.asarray(v), jnp.asarray(pos), jnp.asarray(valid),
                     jnp.full((B, 1), C + step), jnp.zeros((B, 1, K * G, D)),
                     jnp.zeros((B, 1, 4)), jnp.ones((B, 1), bool))
        (k2, v2, _, val2), st_ = hook(io, jnp.asarray(probs), st_)
        for h in range(K):
            rk, rv, rval, racc, rtau = ref[h]
            rk, rv, rval = k[0, h], v[0, h], valid[0, h]
            out = ref_decode_step(m, rk, rv, pos[0, h], rval, racc,
                                  probs[0, h, :, 0].mean(0), rtau, 10, 2)
            np.testing.assert_array_equal(np.asarray(val2[0, h]), out[2])
            np.testing.assert_allclose(np.asarray(k2[0, h]), out[0], atol=2e-5)
            np.testing.assert_allclose(np.asarray(v2[0, h]), out[1], atol=2e-5)
            np.testing.assert_allclose(float(st_["tau"][0, 0, h]), out[4], atol=1e-5)
            np.testing.assert_allclose(np.asarray(st_["acc"][0, 0, h]), out[3], atol=1e-5)
            seen.add((out[5], out[6]))
            ref[h] = (None, None, None, out[3], out[4])
        k, v, valid = np.asarray(k2).copy(), np.asarray(v2).copy(), np.asarray(val2).copy()
    assert {(1, 0), (0, 1)} <= seen, seen  # both a merge and a discard were exercised


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 10**6), st.sampled_from(["softmax", "mean"]))
def test_merge_convex_and_span(seed, kind):
    rng = np.random.default_rng(seed)
    C, D = 10, 6
    k = rng.normal(size=(C, D)).astype(np.float32)
    v = rng.normal(size=(C, D)).astype(np.float32)
    gone = rng.random(C) < 0.4
    keep = ~gone
    keep[0] = True
    gone[0] = False
    k2, v2, merged, _ = merge(jnp.asarray(k), jnp.asarray(v), jnp.asarray(keep),
                              jnp.asarray(gone), jnp.asarray(-1.0), kind)
    rk, rv, _ = ref_merge(k, v, keep, gone, -1.0, kind)
    np.testing.assert_allclose(np.asarray(k2), rk, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v2), rv, atol=1e-5)
    if kind == "softmax":  # weights e/(e+sum) and exp(u)/(e+sum): positive, sum to 1
        for j in np.flatnonzero(keep):
            srcs = [j] + [i for i in np.flatnonzero(np.asarray(merged))
                          if np.argmax(_cos(k[i:i + 1], k[keep])[0]) ==
                          list(np.flatnonzero(keep)).index(j)]
            w, *_ = np.linalg.lstsq(k[srcs].T, np.asarray(k2)[j], rcond=None)
            assert np.all(w > -1e-4) and abs(w.sum() - 1) < 1e-3 or len(srcs) > D


def _run(params, cfg, m, ids, new, q=None):
    return engine.run(params, cfg, [ids], m, questions=q, max_new_tokens=new, stop_ids=())


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 1000), st.sampled_from(["d2o", "d2o_code"]))
def test_budget_and_sinks_invariants(pair, seed, name):
    """Fixed budget per method (one compilation each); prompts drawn."""
    _, cfg, params = pair
    m = methods.create(name, budget=16)
    ids = np.random.default_rng(seed).integers(3, 97, N).tolist()
    logits, cache, state, stats = engine.prefill(
        params, jnp.array([ids]), jnp.ones((1, N), bool), cfg=cfg, method=m,
        capacity=m.kept_slots(N) + 1)
    s = np.asarray(state["budget"])[:, 0]
    for new in range(4):
        live = np.asarray(cache.valid).sum(-1)[:, 0]  # [L, K]
        assert np.all(live <= s[:, None])
        for p in range(m.sinks):
            assert np.all(np.any(np.asarray(cache.valid & (cache.pos == p)), -1))
        logits, cache, state = engine.extend(params, cache, jnp.array([[5 + new]]),
                                             jnp.ones((1, 1), bool), state, cfg=cfg, method=m)


def test_merge_false_equals_h2o(pair):
    """Same budgets: d2o with merge=False, layer_budgets=False, sinks=0, cap=1 and H2O's
    recent_ratio keeps exactly H2O's cache (recent M = max(1, int(budget * ratio)))."""
    _, cfg, params = pair
    ids = np.random.default_rng(3).integers(3, 97, N).tolist()
    d = methods.create("d2o", budget=16, merge=False, layer_budgets=False, sinks=0, cap=1.0,
                       recent_ratio=0.5)
    h = methods.create("h2o", budget=16, recent_ratio=0.5)
    gd, gh = _run(params, cfg, d, ids, 6), _run(params, cfg, h, ids, 6)
    assert gd.tokens == gh.tokens
    for a, b in [(gd.cache.valid, gh.cache.valid), (gd.cache.pos, gh.cache.pos)]:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(gd.cache.k), np.asarray(gh.cache.k), atol=1e-6)


@pytest.mark.parametrize("name", ["d2o", "d2o_code"])
def test_engine_run_both_scenarios(pair, name):
    _, cfg, params = pair
    ids = np.random.default_rng(4).integers(3, 97, N).tolist()
    m = methods.create(name, budget=16)
    g = _run(params, cfg, m, ids, 8)
    assert len(g.tokens[0]) == 8
    assert sum(np.asarray(g.state["merges"]).ravel()) + sum(
        np.asarray(g.state["discards"]).ravel()) > 0
    if name == "d2o":  # context-only: question chunk on top, evicted back to S_l
        g2 = _run(params, cfg, m, ids[:40], 4, q=[ids[40:]])
        live = np.asarray(g2.cache.valid).sum(-1)[:, 0]
        assert np.all(live <= np.asarray(g2.state["budget"])[:, 0, None])
    # uniform budgets option (the code variant still keeps layers 0, 1, L-1 whole)
    m2 = dataclasses.replace(m, layer_budgets=False)
    s = np.asarray(m2.budgets(jnp.arange(L, dtype=jnp.float32)[:, None], jnp.array([N])))[:, 0]
    want = [N, N, 16, N] if name == "d2o_code" else [16] * L
    assert list(s) == want
