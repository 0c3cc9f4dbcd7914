"""kvjax.compression.scoring against plain numpy (and torch's pooling) on random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.compression import scoring

RTOL = 1e-5


def _softmax_np(s, ok):
    s = np.where(ok, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.where(ok, np.exp(s - m), 0)
    z = p.sum(-1, keepdims=True)
    return p / np.where(z > 0, z, 1)


def _inputs(seed, B=2, T=24, H=4, K=2, D=8, pads=(0, 5)):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32) * 2
    k = rng.normal(size=(B, K, T, D)).astype(np.float32) * 2
    v = rng.normal(size=(B, K, T, D)).astype(np.float32)
    valid = np.ones((B, T), bool)
    for b, p in enumerate(pads):
        valid[b, :p] = False
    pos = np.cumsum(valid, 1) - 1
    return q, k, v, valid, pos


def _probs_np(q, k, valid, pos):
    """Full causal softmax [B, K, G, T, T] over live keys, at 1/sqrt(d)."""
    B, T, H, D = q.shape
    K = k.shape[1]
    qg = q.reshape(B, T, K, H // K, D)
    s = np.einsum("btkgd,bksd->bkgts", qg, k) / np.sqrt(D)
    ok = valid[:, None, None, None, :] & (pos[:, None, None, None, :] <= pos[:, None, None, :, None])
    return _softmax_np(s, ok)


@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pool1d_matches_torch(kernel, kind):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(kernel).random((3, 4, 19)).astype(np.float32)
    f = torch.nn.functional.avg_pool1d if kind == "avg" else torch.nn.functional.max_pool1d
    ref = f(torch.tensor(x).reshape(12, 1, 19), kernel_size=kernel, padding=kernel // 2,
            stride=1).reshape(3, 4, 19).numpy()
    np.testing.assert_allclose(np.asarray(scoring.pool1d(jnp.asarray(x), kernel, kind)), ref,
                               rtol=RTOL, atol=1e-7)


def test_pool1d_rejects_even_kernel_and_unknown_kind():
    with pytest.raises(ValueError, match="odd"):
        scoring.pool1d(jnp.ones((2, 8)), 4, "avg")
    with pytest.raises(ValueError, match="allowed"):
        scoring.pool1d(jnp.ones((2, 8)), 3, "median")


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_window_attention(reduce):
    q, k, v, valid, pos = _inputs(0)
    w = 6
    p = _probs_np(q, k, valid, pos)[..., -w:, : -w]  # window rows, prefix columns
    ref = p.mean(3) if reduce == "mean" else p.sum(3)
    out = scoring.window_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), w, reduce)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=RTOL, atol=1e-7)
    assert np.all(np.asarray(out)[1, :, :, :5] == 0)  # padding columns get no attention


def test_window_scores_padding_equals_unpadded():
    """Left padding changes nothing: the padded element's scores equal its unpadded ones
    (avg pooling's zero padding is what the padding columns hold)."""
    q, k, v, valid, pos = _inputs(1, pads=(0, 7))
    for kind in ("avg", "max"):
        s = scoring.snap_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), 4, 5, kind)
        s1 = scoring.snap_scores(jnp.asarray(q[1:, 7:]), jnp.asarray(k[1:, :, 7:]),
                                 jnp.ones((1, 17), bool), 4, 5, kind)
        np.testing.assert_allclose(np.asarray(s)[1, :, 7:], np.asarray(s1)[0], rtol=RTOL,
                                   atol=1e-7)


@pytest.mark.parametrize("how", ["mean", "max", "sum"])
def test_gqa_reduce(how):
    x = np.random.default_rng(2).random((2, 3, 4, 5)).astype(np.float32)
    ref = getattr(np, how)(x, axis=2)
    np.testing.assert_allclose(np.asarray(scoring.gqa_reduce(jnp.asarray(x), how)), ref, rtol=RTOL)
    with pytest.raises(ValueError, match="allowed"):
        scoring.gqa_reduce(jnp.asarray(x), "median")


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), block=st.sampled_from([1, 5, 8, 24, 64]),
       tiled=st.booleans())
def test_cumulative_attention_blocks(seed, block, tiled):
    """Column sums over every valid query, whatever the query block (5 does not divide 24),
    in query bands or in tiles."""
    q, k, v, valid, pos = _inputs(seed)
    ref = _probs_np(q, k, valid, pos)
    ref = np.where(valid[:, None, None, :, None], ref, 0).sum(3)
    K = k.shape[1]
    kpos = np.broadcast_to(pos[:, None], (2, K, 24))
    kval = np.broadcast_to(valid[:, None], (2, K, 24))
    out = scoring.cumulative_attention(*map(jnp.asarray, (q, k, pos, valid, kpos, kval)),
                                       block=block, tiled=tiled)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)


def test_cumulative_attention_tiles_equal_query_blocks():
    """The tiled column sums (T, S multiples of the block) against the query-block fold, on
    keys that are not the queries' own: a cache of 16 older slots (per-head holes) ahead
    of a chunk of 16 queries, one row wholly padding in its first query tile (all of its
    tiles are skipped or dead), one query with no live key. Tolerance: float32 sums in
    another order (1e-6 relative)."""
    rng = np.random.default_rng(5)
    B, T, S, H, K, D, blk = 2, 16, 32, 4, 2, 8, 8
    q = rng.normal(size=(B, T, H, D)).astype(np.float32) * 2
    k = rng.normal(size=(B, K, S, D)).astype(np.float32) * 2
    qvalid = np.ones((B, T), bool)
    qvalid[1, :9] = False
    qpos = 16 + np.cumsum(qvalid, 1) - 1
    kvalid = rng.random((B, K, S)) < 0.8
    kvalid[:, :, 16:] = qvalid[:, None]
    kvalid[0, :, :17] = False  # row 0's first query sees no live key
    kpos = np.concatenate([np.broadcast_to(np.arange(16), (B, K, 16)),
                           np.broadcast_to(qpos[:, None], (B, K, T))], axis=2)
    args = [jnp.asarray(x) for x in (q, k, qpos, qvalid, kpos, kvalid)]
    tiled = scoring.cumulative_attention(*args, block=blk, tiled=True)
    folded = scoring.cumulative_attention(*args, block=blk)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(folded), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(tiled)[~np.broadcast_to(kvalid[:, :, None], tiled.shape)] == 0)


def test_cumulative_attention_takes_the_prompt_attentions_lse():
    """The column sums' first pass (each query's log-sum-exp) replaced by the one the
    blocked prompt attention returns (`LayerIO.lse`), on a left-padded prompt of 512
    (its tiles 256 x 256 there, 64 x 64 here; padding queries see a live key here, and
    must still add nothing): equal to the two-pass sums. Tolerance: float32 sums of the
    normaliser in another order (1e-6 relative)."""
    from kvjax.models import attention

    rng = np.random.default_rng(7)
    B, T, H, K, D = 2, 512, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, T, H, D)).astype(np.float32) * 2)
    k, v = (jnp.asarray(rng.normal(size=(B, K, T, D)).astype(np.float32) * 2)
            for _ in range(2))
    valid = jnp.ones((B, T), bool).at[0, :200].set(False)
    pos = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0)
    kpos, kval = (jnp.broadcast_to(x[:, None], (B, K, T)) for x in (pos, valid))
    _, lse = attention.attend_blocked(q, k, v, pos, kpos, kval, None, ordered=True,
                                      with_lse=True)
    args = (q, k, pos, valid, kpos, kval)
    given = scoring.cumulative_attention(*args, block=64, tiled=True, lse_BKGT=lse)
    own = scoring.cumulative_attention(*args, block=64, tiled=True)
    np.testing.assert_allclose(np.asarray(given), np.asarray(own), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(given)[0, :, :, :200] == 0)  # padding columns


def test_column_sums_bench_runs(capsys):
    """`python -m kvjax.bench.column_sums` on a small prompt: one row, the sums given the
    attention's log-sum-exp equal to the two-pass ones (its last column)."""
    from kvjax.bench import column_sums

    assert column_sums.main(["--contexts", "512", "--batch", "1", "--repeats", "1"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[0] == "512" and float(row[-1]) < 1e-5, row


def test_observed_attention_divides_by_queries_seen():
    q, k, v, valid, pos = _inputs(3)
    acc = _probs_np(q, k, valid, pos)
    acc = np.where(valid[:, None, None, :, None], acc, 0).sum(3)
    n = valid.sum(1)
    ref = acc / np.maximum(n[:, None] - pos, 1)[:, None, None, :]
    out = scoring.observed_attention(*map(jnp.asarray, (q, k, pos, valid)), block=7)
    ok = valid[:, None, None, :]
    np.testing.assert_allclose(np.asarray(out)[np.broadcast_to(ok, ref.shape)],
                               ref[np.broadcast_to(ok, ref.shape)], rtol=1e-5, atol=1e-7)


def test_last_token_attention():
    q, k, v, valid, pos = _inputs(4)
    ref = _probs_np(q, k, valid, pos)[..., -1, :]
    out = scoring.last_token_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(np.asarray(out).sum(-1), 1.0, rtol=1e-5)


def test_value_norms():
    q, k, v, valid, pos = _inputs(5)
    np.testing.assert_allclose(np.asarray(scoring.v_norms(jnp.asarray(v))),
                               np.abs(v).sum(-1), rtol=RTOL)
    np.testing.assert_allclose(np.asarray(scoring.v_norms(jnp.asarray(v), 2)),
                               np.linalg.norm(v, axis=-1), rtol=RTOL)
    m = np.asarray(scoring.max_value_norm(jnp.asarray(v), jnp.asarray(valid)))
    np.testing.assert_allclose(m[1], np.abs(v[1, :, 5:]).sum(-1).max(-1), rtol=RTOL)


def test_scores_under_jit_equal_eager():
    q, k, v, valid, pos = map(jnp.asarray, _inputs(6))
    f = lambda q, k, valid: scoring.snap_scores(q, k, valid, 4, 7, "max", "mean")
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, valid)), np.asarray(f(q, k, valid)),
                               rtol=1e-6, atol=1e-8)
