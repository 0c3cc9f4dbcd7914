"""kvjax.compression.budgets: PyramidKV's schedule (= kvpress), AdaKV's flattened selection (= a numpy
transcription of kvpress `AdaKVPress.compress`), and their invariants."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.compression import budgets


def _kvpress_pyramid(budget, n, L, window, beta):
    kvpress = pytest.importorskip("kvpress")
    press = kvpress.PyramidKVPress(compression_ratio=1 - budget / n, window_size=window,
                                   beta=beta)
    out = []
    for layer in range(L):
        module = types.SimpleNamespace(layer_idx=layer,
                                       config=types.SimpleNamespace(num_hidden_layers=L))
        out.append(press.get_layer_budget(module, n))
    return out


@settings(max_examples=200, deadline=None)
@given(n=st.integers(16, 4096), frac=st.floats(0.02, 1.0), L=st.integers(1, 40),
       window=st.integers(1, 64), beta=st.sampled_from([1, 2, 5, 10, 20]))
def test_pyramid_equals_kvpress(n, frac, L, window, beta):
    budget = max(1, int(n * frac))
    if not (1 - budget / n) < 1 or n * (1 - (1 - budget / n)) != budget:
        return  # kvpress takes a ratio: only budgets it can express exactly
    assert list(budgets.pyramid(budget, n, L, window, beta)) == \
        _kvpress_pyramid(budget, n, L, window, beta)


def test_pyramid_falls_back_to_uniform_at_the_qwen_budgets():
    """What results/lava.md and criticalkv.md read: on Qwen2.5-0.5B (24 layers), window 32,
    beta 20, 1/8 and 1/16 of 4096 are below 20 windows, so every layer keeps the budget
    (PyramidKV is SnapKV there); 1/8 of 8192 (1024) is the first where the pyramid runs."""
    for budget in (512, 256):
        assert set(budgets.pyramid(budget, 4096, 24, 32, 20).tolist()) == {budget}
    tiers = budgets.pyramid(1024, 8192, 24, 32, 20)
    assert tiers[0] > 1024 > tiers[-1] and abs(int(np.sum(tiers)) - 1024 * 24) < 24


def _kvpress_pyramid_at_ratio(r, n, L, window, beta):
    kvpress = pytest.importorskip("kvpress")
    press = kvpress.PyramidKVPress(compression_ratio=r, window_size=window, beta=beta)
    return [press.get_layer_budget(types.SimpleNamespace(
        layer_idx=layer, config=types.SimpleNamespace(num_hidden_layers=L)), n)
        for layer in range(L)]


def _pyramidkv_at_ratio(r, n, L, window, beta):
    """The layer budgets `PyramidKV.with_ratio` runs with on an n-token prompt: its table's
    row n (the table the prefill indexes with the prompt's length)."""
    from kvjax import methods

    m = methods.PyramidKV(window=window, beta=beta).with_ratio(r, n)
    table = np.asarray(m.init_state(types.SimpleNamespace(num_layers=L), 1, n))
    return table[min(n, table.shape[0] - 1)].tolist()


@settings(max_examples=300, deadline=None)
@given(n=st.integers(16, 8192), r=st.floats(0.0, 0.99), L=st.integers(1, 40),
       window=st.integers(1, 64), beta=st.sampled_from([1, 2, 5, 10, 20]))
def test_pyramid_at_ratio_equals_kvpress_at_any_n(n, r, L, window, beta):
    """`--ratio r`: kvpress's schedule for every n and r, not only where n (1 - r) is an
    integer (the average budget is the float n (1 - r), never its integer part)."""
    assert _pyramidkv_at_ratio(r, n, L, window, beta) == \
        _kvpress_pyramid_at_ratio(r, n, L, window, beta)


def test_pyramid_at_ratio_keeps_the_float():
    """n = 640, r = 0.8: n (1 - r) = 127.99999999999997. Its integer part (the old path)
    kept 127 per head where kvpress keeps 128 (the SnapKV fallback at window 32)."""
    n, r, L, w = 640, 0.8, 12, 32
    theirs = _kvpress_pyramid_at_ratio(r, n, L, w, 20)
    assert theirs == [128] * L
    assert list(budgets.pyramid(int(n * (1 - r)), n, L, w, 20)) == [127] * L  # the old path
    assert _pyramidkv_at_ratio(r, n, L, w, 20) == theirs
    # in the pyramid regime too (window 2): layer 0 keeps 250 where the integer part gives 248
    theirs = _kvpress_pyramid_at_ratio(r, n, L, 2, 20)
    assert _pyramidkv_at_ratio(r, n, L, 2, 20) == theirs
    assert list(budgets.pyramid(int(n * (1 - r)), n, L, 2, 20)) != theirs


@settings(max_examples=200, deadline=None)
@given(n=st.integers(64, 8192), budget=st.integers(8, 2048), L=st.integers(2, 40),
       window=st.integers(1, 32), beta=st.sampled_from([2, 5, 10, 20]))
def test_pyramid_shape(n, budget, L, window, beta):
    """Non-increasing over layers, mean = budget up to rounding, >= window in the pyramid
    regime, uniform in the fallback."""
    if budget > n:
        return
    b = budgets.pyramid(budget, n, L, window, beta)
    assert np.all(np.diff(b) <= 0)
    assert abs(b.mean() - budget) <= 0.5 + 1e-9
    if len(set(b.tolist())) > 1:
        assert b.min() >= window - 0.5 and b.max() <= n - window + 0.5
    else:
        assert b[0] == budget


def test_pyramid_table_rows():
    t = budgets.pyramid_table(40, 200, 6, 2, 20)
    assert t.shape == (2 * 40 + 2 + 2, 6)
    for n in (40, 60, 83, 2 * 40 + 2 + 1):
        assert list(t[n]) == list(budgets.pyramid(40, n, 6, 2, 20))
    assert list(budgets.pyramid(40, 1000, 6, 2, 20)) == list(t[-1])  # longer: the last row
    with pytest.raises(ValueError, match="beta"):
        budgets.pyramid(40, 100, 6, 2, 0.5)


def _adakv_np(scores, b, alpha):
    """kvpress AdaKVPress.compress in numpy on [K, n] scores (window already +large)."""
    K, n = scores.shape
    s = scores.astype(np.float64).copy()
    n_safe = int(b * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if b > 0 else 0
    for h in range(K):
        top = np.argsort(-s[h], kind="stable")[:n_safe]
        s[h, top] = np.finfo(np.float64).max
    order = np.argsort(-s.reshape(-1), kind="stable")[: K * b]
    keep = np.zeros(K * n, bool)
    keep[order] = True
    return keep.reshape(K, n)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.sampled_from([1, 2, 4]), n=st.sampled_from([16, 41]),
       w=st.integers(1, 6), alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0]), data=st.data())
def test_flattened_heads(seed, K, n, w, alpha, data):
    b = data.draw(st.integers(w + 1, n))
    rng = np.random.default_rng(seed)
    s = rng.random((1, K, n)).astype(np.float32)
    s[..., n - w:] = np.inf  # window forced
    n_safe = int(b * alpha)
    n_safe = (max(1, n_safe) if alpha > 0 else 0)
    keep = np.asarray(budgets.flattened_heads(jnp.asarray(s), jnp.array([[b]]),
                                              jnp.array([n_safe]), b, n_safe))[0]
    assert keep.sum() == K * b  # the layer's total is exact
    assert keep[:, n - w:].all()  # window live in every head
    per_head = keep.sum(-1)
    assert np.all(per_head >= max(w, n_safe)) and np.all(per_head <= n)
    for h in range(K):  # the safeguard: each head's own top n_safe
        assert keep[h, np.argsort(-s[0, h], kind="stable")[:n_safe]].all()
    ref = _adakv_np(np.where(np.isinf(s[0]), 1e30, s[0]), b, alpha)
    np.testing.assert_array_equal(keep, ref)


def test_flattened_heads_per_element_budgets_under_jit():
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.random((3, 2, 30)).astype(np.float32))
    b = jnp.array([[5], [10], [12]])
    safe = jnp.array([1, 2, 2])
    f = lambda s, b, safe: budgets.flattened_heads(s, b, safe, 12, 2)
    keep = np.asarray(jax.jit(f)(s, b, safe))
    np.testing.assert_array_equal(keep, np.asarray(f(s, b, safe)))
    assert keep.sum((1, 2)).tolist() == [10, 20, 24]


def test_adakv_code_counts():
    """FFY0/AdaKV: counts in a flattened top-K*base, mixed with the floor."""
    rng = np.random.default_rng(1)
    s = rng.random((1, 4, 50)).astype(np.float32)
    base, alpha = 20, 0.2
    order = np.argsort(-s[0].reshape(-1), kind="stable")[: 4 * base] // 50
    count = np.bincount(order, minlength=4)
    ref = np.round(count * (1 - alpha) + int(base * alpha)).astype(int)
    out = np.asarray(budgets.adakv_code_counts(jnp.asarray(s), jnp.array([base]), alpha))[0]
    np.testing.assert_array_equal(out, ref)
    assert abs(out.sum() - 4 * base) <= 4


def test_uniform():
    assert budgets.uniform(64, 3).tolist() == [64, 64, 64]


@pytest.mark.parametrize("seed", range(6))
def test_water_fill_is_the_clipped_proportional_fill(seed):
    """`water_fill` (D2O's layer sizes and LAVa's refilled budgets): x = clip(c w, lo, hi)
    with the c that makes sum x = total, against a float64 bisection for c (1e-3 absolute:
    float32 sums of ~L values of up to ~100); totals outside [sum lo, sum hi] land on the
    bound; a weight-0 layer with hi = 0 holds 0. `largest_remainder` keeps the sum and
    moves no size by more than its fractional part."""
    from kvjax.compression.budgets import largest_remainder, water_fill

    rng = np.random.default_rng(seed)
    L = 12
    w = rng.random(L) * (rng.random(L) > 0.2)
    lo = np.where(w > 0, rng.integers(0, 4, L), 0).astype(float)
    hi = np.where(w > 0, lo + rng.integers(1, 60, L), 0).astype(float)
    for total in (lo.sum() - 5, (lo.sum() + hi.sum()) / 2, hi.sum() * 0.9, hi.sum() + 5):
        x = np.asarray(water_fill(jnp.asarray(w), jnp.asarray(lo), jnp.asarray(hi), total))
        if total <= lo.sum():
            np.testing.assert_allclose(x, lo, atol=1e-3)
            continue
        if total >= hi.sum():
            np.testing.assert_allclose(x, hi, atol=1e-3)
            continue
        a, b = 0.0, 1e9
        for _ in range(200):
            c = (a + b) / 2
            a, b = (c, b) if np.clip(c * w, lo, hi).sum() < total else (a, c)
        np.testing.assert_allclose(x, np.clip(b * w, lo, hi), atol=1e-3)
        t = int(total)
        s = np.asarray(largest_remainder(jnp.asarray(x, jnp.float32), jnp.asarray(hi), t))
        assert s.sum() == t and np.all(s >= np.floor(x)) and np.all(s <= np.ceil(x))


@pytest.mark.parametrize("bad", [0, -3, 1.5, "128", True, None])
def test_a_bad_budget_is_refused_at_construction(bad):
    """One error naming the value, where the method is made (not later inside JAX)."""
    from kvjax import methods

    with pytest.raises(ValueError, match=rf"snapkv: budget={bad!r}: expected an integer >= 1"):
        methods.create("snapkv").with_budget(bad)
    with pytest.raises(ValueError, match="budget="):
        methods.create("h2o", budget=bad)


def test_float_budgets_only_where_a_method_keeps_one():
    from kvjax import methods

    assert methods.create("pyramidkv").with_ratio(0.875, 1000).budget == 125.0
    assert methods.create("sliminfer").budget is None  # its schedule sets the budget
    assert methods.create("pyramidkv").with_ratio(0.97, 16).budget == pytest.approx(0.48)
    with pytest.raises(ValueError, match="pyramidkv: budget=0: expected a number > 0"):
        methods.create("pyramidkv", budget=0)
