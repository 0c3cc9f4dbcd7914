"""RoCo (`roco`) and CaM (`cam`), the D2O paper's baselines (docs/methods.md "D2O").

- Step-by-step references in plain numpy over HF eager attention of the same weights
  (`hf_decode`): prefill selection from the prompt's attentions, then decode tokens one by
  one through the HF layers over the reference's own cache, eviction (and CaM's merge)
  written out; kvjax's cache (keys, values, positions, validity) and state equal after
  prefill and after every step. CaM's Bernoulli draw is the one thing the reference takes
  from kvjax's side: the same `jax.random.uniform` of the same folded key (the PRNG is the
  method's randomness source, not its logic).
- Invariants (hypothesis): budget exact after every step, sinks / start and newest live,
  positions unique, RoCo's counts c = next position - position, dead slots' state zero;
  CaM's merge: mass conservation, targets, probability, determinism per key, Bernoulli
  frequency; CaM without merging == StreamingLLM with `start` sinks (`slow`: four more
  compilations).
- End to end on the bundled model: `python -m kvjax.run` (in process) for both, then the
  same runs through `engine.run` (cached executables) for the method state.

Tolerance: fp32, rtol = 2e-5, atol = 5e-5 on keys/values (HF and kvjax projections differ
by fp32 rounding; a decoded token's key at layer l went through l layers of both: seen up to
3e-5 absolute on entries of magnitude ~5). The same on RoCo's moments s, s2 (sums of up to
N + STEPS attention probabilities, each computed over those keys): seen up to 1.1e-5
absolute on s and 3.3e-6 on s2 (values 0.07-3.6) on an AMD EPYC machine, where the earlier
rtol 1e-5 / atol 1e-6 failed on one entry of 0.074 (2.1e-6 off) although an earlier machine
passed it. A missed or doubled step moves an entry by one probability, ~1/N = 2e-2.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import engine, methods
from kvjax.methods.d2o.cam import cam_merge

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")
hf_decode = pytest.importorskip("hf_decode")

L = 4
N = 48
STEPS = 6
# one compiled program per method for the reference and the invariants (same N, capacity);
# RoCo with P = int(24 * 0.5) - 4 + 1 = 9 std-protected entries, CaM with 8 merge targets
CONFIGS = {"roco": dict(budget=24, sinks=4, recent=4, recent_ratio=0.5),
           "cam": dict(budget=24, start_ratio=0.25, merge_budget=8, seed=3)}


@pytest.fixture(scope="module")
def pair():
    return hf_models.build_pair("llama_llama3rope_gqa4", seed=1, scale=0.3, layers=L)


def _prefill(m, params, cfg, ids):
    return engine.prefill(params, jnp.array([ids]), jnp.ones((1, N), bool), cfg=cfg, method=m,
                          capacity=m.budget + 1)


def _extend(m, params, cfg, cache, state, tok):
    return engine.extend(params, cache, jnp.array([[tok]]), jnp.ones((1, 1), bool), state,
                         cfg=cfg, method=m)


# ---- plain-numpy references ---------------------------------------------------------------


def roco_protected(m, pos, s, s2, c):
    """Sinks, the `recent` newest, and the P highest-std others (stable: lower index first)."""
    mean = s / c
    std = np.sqrt(np.maximum(s2 / c - mean**2, 0.0))
    base = (pos < m.sinks) | (pos > pos.max() - m.recent)
    rest = np.flatnonzero(~base)
    P = max(0, int(m.budget * m.recent_ratio) - m.recent + 1)
    prot = base.copy()
    prot[rest[np.argsort(-std[rest], kind="stable")[:P]]] = True
    return prot, mean


def roco_ref_prefill(m, attn, K_, V_):
    """Per layer, per head: the kept entries (pos, k, v, s, s2, c) by EasyKV's rule."""
    Lh, H, n, _ = attn.shape
    Kh = K_.shape[1]
    G = H // Kh
    out = []
    for l in range(Lh):
        heads = []
        for h in range(Kh):
            a = attn[l, h * G:(h + 1) * G].mean(0)  # [query, key], GQA mean first
            s, s2 = a.sum(0), (a**2).sum(0)
            c = (n - np.arange(n)).astype(np.float64)  # queries that see key i: n - i
            pos = np.arange(n)
            prot, mean = roco_protected(m, pos, s, s2, c)
            rest = np.flatnonzero(~prot)
            keep = prot.copy()
            keep[rest[np.argsort(-mean[rest], kind="stable")[: m.budget - prot.sum()]]] = True
            heads.append(dict(pos=pos[keep], k=K_[l, h][keep], v=V_[l, h][keep], s=s[keep],
                              s2=s2[keep], c=c[keep]))
        out.append(heads)
    return out


def roco_ref_step(m, r, a, kn, vn, position):
    """One decoding token for one (layer, head): add the moments, evict the lowest mean
    outside the protected entries when over budget."""
    r = dict(pos=np.append(r["pos"], position), k=np.vstack([r["k"], kn]),
             v=np.vstack([r["v"], vn]), s=np.append(r["s"], 0.0) + a,
             s2=np.append(r["s2"], 0.0) + a**2, c=np.append(r["c"], 0.0) + 1)
    if len(r["pos"]) > m.budget:
        prot, mean = roco_protected(m, r["pos"], r["s"], r["s2"], r["c"])
        i = int(np.argmin(np.where(prot, np.inf, mean)))
        r = {key: np.delete(x, i, axis=0) for key, x in r.items()}
    return r


def cam_ref_prefill(m, K_, V_):
    """Start + most recent: positions < start and the last budget - start."""
    n = K_.shape[2]
    pos = np.arange(n)
    keep = (pos < m.start) | (pos >= n - (m.budget - m.start))
    return [[dict(pos=pos[keep], k=K_[l, h][keep], v=V_[l, h][keep])
             for h in range(K_.shape[1])] for l in range(K_.shape[0])]


def cam_ref_step(m, r, a, kn, vn, position, u):
    """One decoding token for one (layer, head): the oldest recent entry i leaves; with
    p = clip(a_i / mean a over the next `merge_budget` kept entries, 0, 1) and the draw u,
    v_j += v_i / #targets for those targets when u < p. -> (r, merged or None)."""
    pos = np.append(r["pos"], position)
    k, v = np.vstack([r["k"], kn]), np.vstack([r["v"], vn]).astype(np.float64)
    merged = None
    if len(pos) > m.budget:
        i = int(np.argmin(np.where(pos >= m.start, pos, np.iinfo(pos.dtype).max)))
        after = np.flatnonzero((pos > pos[i]) & (pos >= m.start))
        targets = after[np.argsort(pos[after])][: m.merge_budget]
        abar = a[targets].mean()
        p = min(max(a[i] / abar, 0.0), 1.0) if abar > 0 else float(a[i] > 0)
        merged = bool(u < p)
        if merged:
            v[targets] += v[i] / len(targets)
        keep = np.arange(len(pos)) != i
        pos, k, v = pos[keep], k[keep], v[keep]
    return dict(pos=pos, k=k, v=v), merged


def _compare(cache, R, state=None, fields=()):
    for l, heads in enumerate(R):
        for h, r in enumerate(heads):
            val = np.asarray(cache.valid[l, 0, h])
            pos = np.asarray(cache.pos[l, 0, h])[val]
            o = np.argsort(pos)
            np.testing.assert_array_equal(pos[o], r["pos"])
            np.testing.assert_allclose(np.asarray(cache.k[l, 0, h])[val][o], r["k"],
                                       rtol=2e-5, atol=5e-5)
            np.testing.assert_allclose(np.asarray(cache.v[l, 0, h])[val][o], r["v"],
                                       rtol=2e-5, atol=5e-5)
            for f in fields:
                np.testing.assert_allclose(np.asarray(state[f][l, 0, h])[val][o], r[f],
                                           rtol=2e-5, atol=5e-5)


def _caches(R):
    return [(np.stack([r["k"] for r in heads]), np.stack([r["v"] for r in heads]))
            for heads in R]


def test_reference_steps_roco(pair):
    model, cfg, params = pair
    m = methods.create("roco", **CONFIGS["roco"])
    assert m.std_protected == 9
    G = cfg.num_heads // cfg.num_kv_heads
    for seed in range(2):
        rng = np.random.default_rng(seed)
        ids = rng.integers(3, 97, N).tolist()
        attn, ks, vs = hf_decode.prefill(model, ids)
        R = roco_ref_prefill(m, attn, ks, vs)
        _, cache, state, _ = _prefill(m, params, cfg, ids)
        _compare(cache, R, state, ("s", "s2", "c"))
        for t, tok in enumerate(rng.integers(3, 97, STEPS).tolist()):
            hf = hf_decode.step(model, tok, N + t, _caches(R))
            for l, (w, kn, vn) in enumerate(hf):
                for h in range(cfg.num_kv_heads):
                    a = w[h * G:(h + 1) * G].mean(0)
                    R[l][h] = roco_ref_step(m, R[l][h], a, kn[h], vn[h], N + t)
                    assert len(R[l][h]["pos"]) == m.budget
            _, cache, state = _extend(m, params, cfg, cache, state, tok)
            _compare(cache, R, state, ("s", "s2", "c"))


def test_reference_steps_cam(pair):
    model, cfg, params = pair
    m = methods.create("cam", **CONFIGS["cam"])
    assert m.start == 6
    G = cfg.num_heads // cfg.num_kv_heads
    outcomes = []
    for seed in range(2):
        rng = np.random.default_rng(seed)
        ids = rng.integers(3, 97, N).tolist()
        _, ks, vs = hf_decode.prefill(model, ids)
        R = cam_ref_prefill(m, ks, vs)
        _, cache, state, _ = _prefill(m, params, cfg, ids)
        _compare(cache, R)
        for t, tok in enumerate(rng.integers(3, 97, STEPS).tolist()):
            hf = hf_decode.step(model, tok, N + t, _caches(R))
            for l, (w, kn, vn) in enumerate(hf):
                key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(m.seed), l), t)
                u = np.asarray(jax.random.uniform(key, (1, cfg.num_kv_heads, 1)))[0, :, 0]
                for h in range(cfg.num_kv_heads):
                    a = w[h * G:(h + 1) * G].mean(0)
                    R[l][h], merged = cam_ref_step(m, R[l][h], a, kn[h], vn[h], N + t, u[h])
                    outcomes.append(merged)
            _, cache, state = _extend(m, params, cfg, cache, state, tok)
            _compare(cache, R)
            np.testing.assert_array_equal(np.asarray(state["step"]), t + 1)
        assert int(np.sum(state["merges"]) + np.sum(state["discards"])) == \
            L * cfg.num_kv_heads * STEPS
    assert True in outcomes and False in outcomes, outcomes  # both Bernoulli outcomes seen


# ---- invariants ---------------------------------------------------------------------------


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 10**6), st.sampled_from(list(CONFIGS)))
def test_budget_and_kept_invariants(pair, seed, name):
    """The reference configurations (compiled once), prompts and tokens drawn, after prefill
    and every step: exactly `budget` live per (layer, head), sinks / start and the newest
    live, positions unique; RoCo: c = next position - position on live slots, state 0 on
    dead ones; CaM: layer-0 keys equal the prompt's own (values merge, keys never)."""
    _, cfg, params = pair
    m = methods.create(name, **CONFIGS[name])
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 97, N).tolist()
    _, cache, state, _ = _prefill(m, params, cfg, ids)
    _, full, _, _ = engine.prefill(params, jnp.array([ids]), jnp.ones((1, N), bool), cfg=cfg,
                                   method=methods.create("full"), capacity=N)
    first = m.sinks if name == "roco" else m.start
    newest = m.recent if name == "roco" else m.budget - m.start
    for t in range(5):
        nxt = N + t
        valid, pos = np.asarray(cache.valid)[:, 0], np.asarray(cache.pos)[:, 0]
        assert np.all(valid.sum(-1) == m.budget)
        for l in range(L):
            for h in range(cfg.num_kv_heads):
                p = pos[l, h][valid[l, h]]
                assert len(set(p)) == m.budget
                assert set(range(first)) <= set(p)
                assert set(range(nxt - newest, nxt)) <= set(p)
                if name == "cam":
                    assert set(p) == set(range(first)) | set(range(nxt - newest, nxt))
        if name == "roco":
            c = np.asarray(state["c"])[:, 0]
            np.testing.assert_array_equal(c[valid], (nxt - pos)[valid])
            for f in ("s", "s2", "c"):
                assert np.all(np.asarray(state[f])[:, 0][~valid] == 0)
        else:
            k0, p0 = np.asarray(cache.k[0, 0]), pos[0]
            for h in range(cfg.num_kv_heads):
                for j in np.flatnonzero(valid[0, h] & (p0[h] < N)):
                    np.testing.assert_allclose(k0[h, j], np.asarray(full.k[0, 0, h, p0[h, j]]),
                                               rtol=1e-6, atol=1e-6)
        _, cache, state = _extend(m, params, cfg, cache, state, int(rng.integers(3, 97)))


def _ref_merge_one(v, pos, kept, gone, a, start, mb, u):
    """cam_merge in numpy for one head (gone entries oldest first, draws u in that order)."""
    v = v.astype(np.float64).copy()
    v0 = v.copy()
    merged, probs = np.zeros(len(pos), bool), np.zeros(len(pos))
    for e, i in enumerate(np.flatnonzero(gone)[np.argsort(pos[gone])]):
        after = np.flatnonzero(kept & (pos >= start) & (pos > pos[i]))
        targets = after[np.argsort(pos[after])][:mb]
        if not len(targets):
            continue
        abar = a[targets].mean()
        p = min(max(a[i] / abar, 0.0), 1.0) if abar > 0 else float(a[i] > 0)
        probs[i] = p
        if u[e] < p:
            merged[i] = True
            v[targets] += v0[i] / len(targets)
    return v, merged, probs


# static (merge_budget, max_evict): one compilation per merge budget drawn
_cam_merge = jax.jit(cam_merge, static_argnums=(6, 8))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 10**6), st.integers(1, 3), st.sampled_from([1, 4]), st.integers(0, 3))
def test_cam_merge_invariants(seed, n_gone, mb, start):
    """cam_merge == its numpy statement; sum of kept values grows by exactly the merged
    values (the mass v_i moves, split over the targets); only targets change; merged is a
    subset of gone; the same key gives the same result."""
    rng = np.random.default_rng(seed)
    B, K, C, D = 2, 2, 10, 3
    v = rng.normal(size=(B, K, C, D)).astype(np.float32)
    pos = np.stack([np.stack([rng.permutation(C) for _ in range(K)]) for _ in range(B)])
    a = rng.random((B, K, C)).astype(np.float32)
    valid = rng.random((B, K, C)) < 0.9
    gone = np.zeros((B, K, C), bool)
    for b in range(B):
        for k in range(K):
            cand = np.flatnonzero(valid[b, k] & (pos[b, k] >= start))
            gone[b, k, rng.choice(cand, min(n_gone, len(cand)), replace=False)] = True
    kept = valid & ~gone
    key = jax.random.PRNGKey(seed)
    out = _cam_merge(jnp.asarray(v), jnp.asarray(pos), jnp.asarray(kept), jnp.asarray(gone),
                     jnp.asarray(a), start, mb, key, 3)
    v2, merged, p = (np.asarray(x) for x in (out[0].into(jnp.asarray(v)), *out[1:]))
    u = np.asarray(jax.random.uniform(key, (B, K, 3)))
    for b in range(B):
        for k in range(K):
            rv, rm, rp = _ref_merge_one(v[b, k], pos[b, k], kept[b, k], gone[b, k], a[b, k],
                                        start, mb, u[b, k])
            np.testing.assert_allclose(v2[b, k], rv, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(merged[b, k], rm)
            np.testing.assert_allclose(p[b, k], rp, rtol=1e-5, atol=1e-6)
            moved = v[b, k][merged[b, k]].sum(0)
            np.testing.assert_allclose(v2[b, k][kept[b, k]].sum(0),
                                       v[b, k][kept[b, k]].sum(0) + moved, atol=1e-4)
    assert not np.any(merged & ~gone)
    np.testing.assert_array_equal(v2[~kept], v[~kept])  # only kept slots ever change
    again = _cam_merge(jnp.asarray(v), jnp.asarray(pos), jnp.asarray(kept), jnp.asarray(gone),
                       jnp.asarray(a), start, mb, key, 3)
    np.testing.assert_array_equal(np.asarray(again[0].into(jnp.asarray(v))), v2)


def test_cam_bernoulli_frequency_and_seed():
    """p = a_i / mean a_targets: 0.3 -> merged in ~30% of 4000 independent heads; p >= 1
    always, a_i = 0 never; other keys give other draws."""
    B, C, D = 4000, 4, 2
    pos = np.broadcast_to(np.arange(C), (B, 1, C))
    gone = np.broadcast_to(np.arange(C) == 0, (B, 1, C))
    v = jnp.ones((B, 1, C, D))

    def run(a0, key):
        a = np.broadcast_to(np.array([a0, 1.0, 1.0, 1.0], np.float32), (B, 1, C))
        return np.asarray(_cam_merge(v, jnp.asarray(pos), jnp.asarray(~gone),
                                     jnp.asarray(gone), jnp.asarray(a), 0, 3, key, 1)[1])[:, 0, 0]

    k1, k2 = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    f = run(0.3, k1)
    assert abs(f.mean() - 0.3) < 0.03, f.mean()
    assert run(1.5, k1).all() and not run(0.0, k1).any()
    assert (run(0.3, k2) != f).any()
    np.testing.assert_array_equal(run(0.3, k1), f)


@pytest.mark.slow
def test_cam_without_merge_is_streaming_llm(pair):
    """merge=False: CaM's start + recent cache == StreamingLLM with `start` sinks (caches and
    logits after prefill and every step)."""
    _, cfg, params = pair
    c = methods.create("cam", budget=16, start_ratio=0.25, merge=False)
    s = methods.create("streaming_llm", budget=16, n_sink=c.start)
    rng = np.random.default_rng(7)
    ids = rng.integers(3, 97, N).tolist()
    outs = [_prefill(m, params, cfg, ids)[:3] for m in (c, s)]
    for t in range(4):
        (lc, cc, _), (ls, cs, _) = outs
        np.testing.assert_allclose(np.asarray(lc), np.asarray(ls), atol=1e-5)
        for x, y in [(cc.valid, cs.valid), (cc.pos, cs.pos), (cc.k, cs.k), (cc.v, cs.v)]:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        tok = int(rng.integers(3, 97))
        outs = [_extend(m, params, cfg, o[1], o[2], tok) for m, o in zip((c, s), outs)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_run_context_only(pair, name):
    """Context-only: an 8-token question chunk goes on top and is evicted back to the
    budget in one step (CaM: 8 evictions per head, merged together), then 4 tokens decode
    in the compiled loop; one eviction per token per (layer, head)."""
    _, cfg, params = pair
    m = methods.create(name, **CONFIGS[name])
    ids = np.random.default_rng(5).integers(3, 97, N).tolist()
    g = engine.run(params, cfg, [ids[:40]], m, questions=[ids[40:]], max_new_tokens=4,
                   stop_ids=())
    assert len(g.tokens[0]) == 4
    assert np.all(np.asarray(g.cache.valid).sum(-1) == m.budget)
    if name == "cam":
        events = np.asarray(g.state["merges"]) + np.asarray(g.state["discards"])
        np.testing.assert_array_equal(events, (8 + 4) * cfg.num_kv_heads)
        assert np.sum(g.state["merges"]) > 0
    else:
        c, pos = np.asarray(g.state["c"]), np.asarray(g.cache.pos)
        valid = np.asarray(g.cache.valid)
        nxt = int(np.asarray(g.cache.next_pos)[0])
        np.testing.assert_array_equal(c[valid], (nxt - pos)[valid])


def test_validation_messages():
    with pytest.raises(ValueError, match="budget=16 must be larger than the 17"):
        methods.create("roco", budget=16, recent=4, recent_ratio=0.8).validate(64, None)
    with pytest.raises(ValueError, match="start_ratio=1.0"):
        methods.create("cam", start_ratio=1.0).validate(256, None)
    with pytest.raises(ValueError, match="merge_budget=0"):
        methods.create("cam", merge_budget=0).validate(256, None)


# ---- end to end on the bundled model --------------------------------------------------------


def test_bundled_cli_and_engine(tmp_path):
    """`python -m kvjax.run --method roco,cam --budget 64` (in process) on the bundled model,
    then the same prompts through engine.run (the CLI's compiled executables are reused) for
    the state: budget live at the end, RoCo's counts, CaM's merges."""
    import kvjax
    from kvjax.cli import main as cli
    from kvjax import tasks

    out = tmp_path / "r.json"
    argv = ["--method", "roco,cam", "--budget", "64", "--task", "niah_single", "--context",
            "256", "--samples", "2", "--output", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    recs = json.loads(out.read_text())["records"]
    assert [r["method"] for r in recs] == ["roco", "cam"]
    for r in recs:
        assert r["budget"] == 64 and 0 <= r["accuracy"] <= 1 and r["kv_fraction"] < 0.5
    model = kvjax.load("tiny-retrieval")
    samples = tasks.generate("niah_single", context_length=256, n=2, seed=0)
    prompts = [model.encode(s.prompt) for s in samples]
    new = max(s.max_new_tokens for s in samples)
    for name in ("roco", "cam"):
        m = methods.create(name).with_budget(64)
        g = engine.run(model.params, model.cfg, prompts, m, max_new_tokens=new)
        valid = np.asarray(g.cache.valid)
        assert np.all(valid.sum(-1) == 64)
        if name == "roco":
            nxt = np.asarray(g.cache.next_pos)[None, :, None, None]
            c = np.asarray(g.state["c"])
            want = np.broadcast_to(nxt - np.asarray(g.cache.pos), c.shape)
            np.testing.assert_array_equal(c[valid], want[valid])
        else:
            assert int(np.sum(g.state["merges"])) > 0 and int(np.sum(g.state["discards"])) > 0
