"""ASL, FastKV, GemFilter: a plain-numpy Algorithm 1-2 over HF eager attentions, the
one-compilation guarantee, batching, invariants and errors.

Reference tolerance: the relative-variance curve agrees to 1e-4 relative (seen: ~1e-6;
ranks are integers, so only a near-tie in pooled scores could move them, and the test
would then show a different kept set rather than a small numeric drift).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import monitoring

from kvjax import engine, methods

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")
F = torch.nn.functional

L = 12


@pytest.fixture(scope="module")
def pair():
    return hf_models.build_pair("llama_llama3rope_gqa4", seed=1, scale=0.3, layers=L)


def reference_asl(attn, select_k, window, kernel, tau, l_min, l_obs, group):
    """Algorithm 1-2 of ASL paper in numpy/torch over HF attention probabilities [L, H, n, n]."""
    n = attn.shape[-1]
    ranks, curve, init_var, sel = [], [], None, None
    for l in range(attn.shape[0]):
        s = attn[l, :, n - window:, : n - window].sum(1)  # [H, n - w]
        pooled = F.avg_pool1d(torch.tensor(s)[None], kernel, 1, kernel // 2)[0].numpy()
        score = pooled.reshape(-1, group, n - window).sum(1).sum(0)  # group sum, head sum
        r = np.empty(n - window)
        r[np.argsort(-score, kind="stable")] = np.arange(1, n - window + 1)
        ranks.append(r)
        if l < l_min:
            curve.append(np.nan)
            continue
        R = np.stack(ranks[max(0, l - l_obs + 1): l + 1])
        union = np.unique(np.concatenate([np.flatnonzero(x <= select_k - window) for x in R]))
        var = np.mean(np.mean((R[:, union] - R[:, union].mean(0)) ** 2, axis=0))
        init_var = var if l == l_min else init_var
        curve.append(var / init_var)
        if var / init_var < tau:
            top = np.flatnonzero(r <= select_k - window)
            sel = (l, np.sort(np.concatenate([top, np.arange(n - window, n)])))
            break
    return sel, np.array(curve), init_var


def _hf_attn(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return np.stack([a[0].float().numpy() for a in out.attentions])


PROMPTS = [list(np.random.default_rng(s).integers(3, 97, 160)) for s in range(10)]
KW = dict(select_k=40, window=8, tau=0.98)  # random weights: rel. variance stays near 1


def test_reference_selection_layer_curve_and_kept_set(pair):
    model, cfg, params = pair
    m = methods.create("asl", **KW)
    seen_layers = set()
    for ids in PROMPTS:
        ref_sel, ref_curve, ref_init = reference_asl(_hf_attn(model, ids), 40, 8, 7, 0.98, L // 3, 8,
                                           cfg.group_size)
        g = engine.run(params, cfg, [ids], m, max_new_tokens=1, stop_ids=())
        curve = np.array(g.stats["relative_variance"][0][: len(ref_curve)])
        np.testing.assert_allclose(curve, ref_curve, rtol=1e-4, equal_nan=True)
        np.testing.assert_allclose(g.stats["init_var"][0], ref_init, rtol=1e-4)
        assert g.stats["tau_crossed"] == g.stats["selected"] == [ref_sel is not None]
        sel_layer = g.stats["selection_layer"][0]
        if ref_sel is None:
            assert sel_layer == -1
            continue
        seen_layers.add(sel_layer)
        assert sel_layer == ref_sel[0]
        # layers after the selection hold exactly the selected tokens, at original positions
        c = g.cache
        for layer in range(sel_layer + 1, L):
            for h in range(cfg.num_kv_heads):
                live = np.asarray(c.pos[layer, 0, h])[np.asarray(c.valid[layer, 0, h])]
                assert list(live) == list(ref_sel[1]) + [len(ids)]  # + the decoded token
    assert len(seen_layers) >= 2, f"prompts should exit at different layers, saw {seen_layers}"


_COMPILES: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: _COMPILES.append(e) if e == "/jax/core/compile/backend_compile_duration" else None)


def test_one_compilation_for_every_selection_layer(pair):
    _, cfg, params = pair
    m = methods.create("asl", **KW)
    engine.run(params, cfg, [PROMPTS[0]], m, max_new_tokens=2, stop_ids=())
    _COMPILES.clear()
    layers = {engine.run(params, cfg, [p], m, max_new_tokens=2, stop_ids=()).stats["selection_layer"][0]
              for p in PROMPTS}
    assert len(layers) >= 2 and _COMPILES == [], (layers, len(_COMPILES))


def test_batch_selects_per_element(pair):
    _, cfg, params = pair
    m = methods.create("asl", **KW)
    prompts = [PROMPTS[3], PROMPTS[5][:150], PROMPTS[0][:131], PROMPTS[8]]
    batch = engine.run(params, cfg, prompts, m, max_new_tokens=6, stop_ids=())
    for i, p in enumerate(prompts):
        one = engine.run(params, cfg, [p], m, max_new_tokens=6, stop_ids=())
        assert one.tokens[0] == batch.tokens[i]
        assert one.stats["selection_layer"][0] == batch.stats["selection_layer"][i]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(12, 100), seed=st.integers(0, 9), variant=st.sampled_from(["asl", "asl_2pass"]))
def test_invariants(pair, k, seed, variant):
    _, cfg, params = pair
    ids = PROMPTS[seed][: 110 + seed]
    m = methods.create(variant, select_k=k, window=8, tau=0.98)
    g = engine.run(params, cfg, [ids], m, max_new_tokens=1, stop_ids=())
    sel = g.stats["selection_layer"][0]
    assert sel == -1 or sel >= L // 3
    c = g.cache
    n = len(ids)
    for layer in range(L):
        for h in range(cfg.num_kv_heads):
            live = np.asarray(c.pos[layer, 0, h])[np.asarray(c.valid[layer, 0, h])][:-1]  # prompt part
            assert list(live) == sorted(set(live))
            if sel == -1 and variant == "asl_2pass":
                assert len(live) == n  # no selection: the full cache
            elif variant == "asl_2pass":
                assert list(live) == list(range(k))  # re-encoded at positions 0..k-1
            else:
                assert len(live) == k and set(range(n - 8, n)) <= set(live)


def test_tiny_tau_never_selects_and_full_before_equals_full(pair):
    _, cfg, params = pair
    ids = PROMPTS[0]
    full = engine.run(params, cfg, [ids], max_new_tokens=8, stop_ids=())
    never = engine.run(params, cfg, [ids], methods.create("asl_full_before", select_k=40, window=8,
                                                          tau=1e-9), max_new_tokens=8, stop_ids=())
    assert never.stats["selection_layer"] == [-1] and never.tokens == full.tokens
    assert never.stats["selected"] == never.stats["tau_crossed"] == [False]
    fallback = engine.run(params, cfg, [ids], methods.create(
        "asl", select_k=40, window=8, tau=1e-9, fallback_layer=5), max_new_tokens=1, stop_ids=())
    assert fallback.stats["selection_layer"] == [5] and fallback.stats["selected"] == [True]
    assert fallback.stats["tau_crossed"] == [False]  # selected by the fallback, not by tau
    keep_all = engine.run(params, cfg, [ids], methods.create("asl_full_before", select_k=len(ids),
                                                             window=8, tau=0.9, fallback_layer=5),
                          max_new_tokens=8, stop_ids=())
    assert keep_all.stats["selection_layer"][0] >= 0 and keep_all.tokens == full.tokens


def test_fixed_layer_baselines(pair):
    _, cfg, params = pair
    ids = PROMPTS[3]
    fk = engine.run(params, cfg, [ids], methods.create("fastkv"), max_new_tokens=1, stop_ids=())
    assert fk.stats["selection_layer"] == [round(15 * L / 32)] and fk.stats["selected"] == [True]
    assert "tau_crossed" not in fk.stats and fk.stats["select_k"] == [int(0.2 * len(ids))]
    gf = engine.run(params, cfg, [ids], methods.create("gemfilter", select_k=32),
                    max_new_tokens=1, stop_ids=())
    assert gf.stats["selection_layer"] == [round(13 * L / 32)]
    live = np.asarray(gf.cache.pos[0, 0, 0])[np.asarray(gf.cache.valid[0, 0, 0])]
    assert list(live) == list(range(33))  # 32 re-encoded tokens + the decoded one


def test_bad_input(pair):
    _, cfg, params = pair
    ids = PROMPTS[0]
    for kw, msg in [(dict(select_k=8, window=8), "select_k=8"), (dict(select_k=500), "select_k=500"),
                    (dict(tau=1.5, select_k=40), "tau=1.5"), (dict(l_min=40, select_k=40), "l_min=40")]:
        with pytest.raises(ValueError, match=msg):
            engine.run(params, cfg, [ids], methods.create("asl", **kw), max_new_tokens=1)
