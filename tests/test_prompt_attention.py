"""The prompt's fused attention path (`attention.attend_fused`, cuDNN's flash attention on
an NVIDIA GPU) and the CPU's tiled one (`attention.attend_blocked`) against kvjax's chunked
attention, through the same `jax.nn` call's xla
implementation on CPU: left and right padding, a sliding window, and whole runs of methods
of the three prefill kinds (the kept sets and tokens must not move).

Tolerance: 1e-5 absolute on unit-scale random inputs (fp32; the two sum in other orders)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import engine, methods
from kvjax.config import ModelConfig
from kvjax.models import attention
from kvjax.pallas import Kernels
from kvjax.train import init_params

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))


@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("pad", ["left", "right"])
def test_fused_equals_chunked(sliding_window, pad):
    B, T, H, K, D = 2, 40, 4, 2, 8
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k, v = (jax.random.normal(x, (B, K, T, D)) for x in ks[1:])
    valid = jnp.ones((B, T), bool)
    valid = valid.at[0, :10].set(False) if pad == "left" else valid.at[0, 30:].set(False)
    pos = engine.positions(valid, jnp.zeros((B,), jnp.int32))
    kpos, kval = (jnp.broadcast_to(x[:, None], (B, K, T)) for x in (pos, valid))
    ref = attention.attend_chunked(q, k, v, pos, kpos, kval, sliding_window)
    got = attention.attend_prompt(q, k, v, pos, kpos, kval, sliding_window, "fused_xla")
    keep = np.asarray(valid)[:, :, None, None]
    np.testing.assert_allclose(np.where(keep, got, 0), np.where(keep, ref, 0), atol=1e-5)
    assert not np.any(np.asarray(got)[~np.asarray(valid)])  # padding queries: zeros


@pytest.mark.parametrize("T, sliding_window, ordered", [  # 64-blocks, 256-blocks, dense,
    (320, None, True), (320, 70, True), (512, None, True), (512, 70, False), (100, None, True),
    (1024, None, True), (1024, 300, True), (1024, None, False)])  # 512 queries x 256 keys
def test_blocked_equals_chunked(T, sliding_window, ordered):
    # the tiled online softmax against the dense one; ordered skips the key blocks past a
    # query block, which a left-padded prompt's mask hides anyway
    B, H, K, D = 2, 4, 2, 8
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k, v = (jax.random.normal(x, (B, K, T, D)) for x in ks[1:])
    valid = jnp.ones((B, T), bool).at[0, :T // 3].set(False)  # one row left-padded
    pos = engine.positions(valid, jnp.zeros((B,), jnp.int32))
    kpos, kval = (jnp.broadcast_to(x[:, None], (B, K, T)) for x in (pos, valid))
    ref = attention.attend_chunked(q, k, v, pos, kpos, kval, sliding_window)
    got = attention.attend_prompt(q, k, v, pos, kpos, kval, sliding_window, "blocked", ordered)
    keep = np.asarray(valid)[:, :, None, None]
    np.testing.assert_allclose(np.where(keep, got, 0), np.where(keep, ref, 0), atol=1e-5)
    assert not np.any(np.asarray(got)[~np.asarray(valid)])  # padding queries: zeros


def test_the_fused_log_sum_exp_gives_the_column_sums():
    """The fused call's softmax statistic (`return_residual`) is the blocked attention's
    log-sum-exp on every real query, and H2O's column sums given it in query bands (no
    softmax of their own: the GPU's path) equal those computed with one. T is no multiple
    of the 128-query band (the last one padded); row 1 is left-padded. 1e-5 relative (fp32)."""
    from kvjax.compression import scoring

    B, T, K, G, D = 2, 320, 2, 3, 16  # the blocked one: 64-key tiles
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(ks[0], (B, T, K * G, D))
    k, v = (jax.random.normal(x, (B, K, T, D)) for x in ks[1:])
    valid = jnp.ones((B, T), bool).at[1, :70].set(False)
    pos = jnp.where(valid, jnp.cumsum(valid, 1) - 1, 0).astype(jnp.int32)
    kpos, kval = (jnp.broadcast_to(x[:, None], (B, K, T)) for x in (pos, valid))
    _, lse = attention.attend_prompt(q, k, v, pos, kpos, kval, None, "fused_xla",
                                     with_lse=True)
    _, ref = attention.attend_blocked(q, k, v, pos, kpos, kval, None, ordered=True,
                                      with_lse=True)
    real = np.asarray(valid)[:, None, None, :]
    np.testing.assert_allclose(np.where(real, lse, 0), np.where(real, ref, 0), atol=1e-5)
    assert np.all(np.isinf(np.asarray(lse)[~np.broadcast_to(real, lse.shape)]))
    want = scoring.cumulative_attention(q, k, pos, valid, kpos, kval, 128)
    got = scoring.cumulative_attention(q, k, pos, valid, kpos, kval, 128, lse_BKGT=lse)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(want)))
    # a bf16 log-sum-exp (what jax returns from cuDNN for bf16 queries) changes nothing
    rounded = lse.astype(jnp.bfloat16).astype(jnp.float32)
    assert float(jnp.max(jnp.where(real, jnp.abs(rounded - lse), 0))) > 1e-3
    got = scoring.cumulative_attention(q, k, pos, valid, kpos, kval, 128, lse_BKGT=rounded)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(want)))


@pytest.mark.parametrize("name, kw", [("full", {}), ("snapkv", dict(budget=40, window=8)),
                                      ("asl", dict(select_k=40, window=8, tau=0.9)),
                                      ("lazyllm", dict(layers=(2, 4))),
                                      # column sums in tiles (blocked) vs query bands
                                      # given the fused call's log-sum-exp
                                      ("h2o", dict(budget=40, block=32)),
                                      ("observed_attention", dict(budget=40, block=32))])
def test_runs_are_equal_with_the_fused_prompt_attention(name, kw):
    params = init_params(CFG, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 64, n)) for n in (90, 117)]
    m = methods.create(name, **kw)
    a = engine.run(params, CFG, prompts, m, max_new_tokens=6, stop_ids=())
    b = engine.run(params, CFG, prompts, m, max_new_tokens=6, stop_ids=(),
                   kernels=Kernels(prefill_attention="fused_xla"))
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(np.asarray(a.cache.valid), np.asarray(b.cache.valid))
    np.testing.assert_array_equal(np.where(a.cache.valid, a.cache.pos, -1),
                                  np.where(b.cache.valid, b.cache.pos, -1))
    # the default: tiles on CPU; on a GPU the chunked xla one (cuDNN refuses float32)
    assert a.stats["kernels"]["prefill_attention"] == (
        "blocked" if jax.default_backend() == "cpu" else "xla")
    assert b.stats["kernels"]["prefill_attention"] == "fused_xla"


def test_auto_never_sends_float32_to_cudnn(monkeypatch):
    """cuDNN's flash attention refuses float32 queries (seen on an H100, jax 0.11.2): on an
    NVIDIA GPU `auto` gives a float32 model the chunked attention, and naming cuDNN for
    one is one clear error."""
    from kvjax.pallas import dispatch

    monkeypatch.setattr(dispatch, "_auto_prompt_attention", lambda: "cudnn")
    assert Kernels().prompt_attention(jnp.bfloat16) == "cudnn"
    assert Kernels().prompt_attention(jnp.float16) == "cudnn"
    assert Kernels().prompt_attention(jnp.float32) == "xla"
    assert Kernels(prefill_attention="cudnn").prompt_attention(jnp.bfloat16) == "cudnn"
    with pytest.raises(ValueError, match="float32"):
        Kernels(prefill_attention="cudnn").prompt_attention(jnp.float32)
