"""kvjax.pallas: every kernel, interpreted on CPU, against its xla reference; lowering for
TPU and CUDA with jax.export; the dispatch switch and its users.

Tolerances (fp32 inputs; what the runs showed is in docs/results/kernels.md):
window scores rtol 1e-5 (scores in [0, window]), decode attention atol 2e-5, value norms
rtol 1e-5, compaction exact. bf16 inputs: scores rtol 1e-4, decode atol 1/64 (the output
is bf16: one ulp at 1 is 1/128, and p is rounded to bf16 before P @ V as in `attend`).
Shapes are drawn from small sets: every new shape is a new compilation of the
interpreter, a few seconds each on 2 cores; `-m slow` widens the draws.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import pallas
from kvjax.models import attention
from kvjax.pallas.ops.compact import pallas_gpu as compact_gpu
from kvjax.pallas.ops.compact import pallas_tpu as compact_tpu
from kvjax.pallas.ops.compact import xla as compact_xla
from kvjax.pallas.ops.decode_attention import pallas_gpu as decode_gpu
from kvjax.pallas.ops.decode_attention import pallas_tpu as decode_tpu
from kvjax.pallas.ops.decode_attention import xla as decode_xla
from kvjax.pallas.ops.value_norms import pallas_gpu as norms_gpu
from kvjax.pallas.ops.value_norms import pallas_tpu as norms_tpu
from kvjax.pallas.ops.value_norms import xla as norms_xla
from kvjax.pallas.ops.window_scores import pallas_gpu as scores_gpu
from kvjax.pallas.ops.window_scores import pallas_tpu as scores_tpu
from kvjax.pallas.ops.window_scores import xla as scores_xla

warnings.filterwarnings("ignore", message=".*pallas_call.*Mosaic GPU.*")

FAST = settings(max_examples=4, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def normal(seed: int, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape)).astype(dtype)


def ragged(n: int, tile: int) -> int:
    """A length that is not a multiple of the tile."""
    return n + 1 if n % tile == 0 else n


# ---- window scores ---------------------------------------------------------------------

def score_case(seed, B, G, K, w, P, D, pad, dtype):
    T = w + P
    q = normal(seed, (B, T, K * G, D), dtype, 2.0)
    k = normal(seed + 1, (B, K, T, D), dtype)
    valid = jnp.ones((B, T), bool).at[0, :pad].set(False)  # left padding of element 0
    return q, k, valid


score_params = st.fixed_dictionaries(dict(
    seed=st.integers(0, 1000), B=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 4, 8]),
    K=st.sampled_from([1, 2]), w=st.sampled_from([1, 8, 32]), P=st.integers(1, 300),
    kernel=st.sampled_from([1, 5, 7]), pooling=st.sampled_from(["avg", "max"]),
    gqa=st.sampled_from(["mean", "sum", "max"]), reduce=st.sampled_from(["mean", "sum"]),
    pad=st.integers(0, 40)))


def check_scores(fn, p, D, tile, dtype, rtol):
    P = ragged(p["P"], tile)
    q, k, valid = score_case(p["seed"], p["B"], p["G"], p["K"], p["w"], P, D,
                             min(p["pad"], P), dtype)
    kw = dict(window=p["w"], kernel=p["kernel"], pooling=p["pooling"], gqa=p["gqa"],
              reduce=p["reduce"])
    ref = scores_xla.window_scores(q, k, valid, **kw)
    out = fn(q, k, valid, **kw, tile=tile, interpret=True)
    assert out.shape == ref.shape == (p["B"], p["K"], P)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=rtol, atol=1e-7)


@settings(max_examples=3, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(score_params)
def test_window_scores_tpu_interpret(p):
    check_scores(scores_tpu.window_scores, p, 32, 128, jnp.float32, 1e-5)


@pytest.mark.slow
@SLOW
@given(score_params, st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_window_scores_tpu_interpret_wide(p, dtype):
    check_scores(scores_tpu.window_scores, p, 64, 128, dtype,
                 1e-5 if dtype == jnp.float32 else 1e-4)


def test_window_scores_tpu_interpret_bf16():
    p = dict(seed=3, B=2, G=4, K=2, w=8, P=200, kernel=7, pooling="max", gqa="mean",
             reduce="mean", pad=30)
    check_scores(scores_tpu.window_scores, p, 64, 128, jnp.bfloat16, 1e-4)


GPU_SCORE_CASES = [
    (dict(seed=1, B=2, G=2, K=2, w=8, P=150, kernel=7, pooling="max", gqa="mean",
          reduce="mean", pad=17), jnp.bfloat16, 64),
    pytest.param(dict(seed=2, B=1, G=8, K=1, w=32, P=100, kernel=5, pooling="avg", gqa="sum",
                      reduce="sum", pad=0), jnp.float32, 32, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("p, dtype, D", GPU_SCORE_CASES)
def test_window_scores_gpu_interpret(p, dtype, D):
    check_scores(scores_gpu.window_scores, p, D, 64, dtype, 1e-5 if dtype == jnp.float32 else 1e-4)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(score_params)
def test_window_scores_gpu_interpret_wide(p):
    check_scores(scores_gpu.window_scores, p, 32, 64, jnp.float32, 1e-5)


def test_window_scores_reference_matches_layerwise_and_scoring():
    """The op's reference = scoring.snap_scores = layerwise.window_scores reduced over G
    (the two scorers differ only in the window reduction's default: mean vs sum)."""
    from kvjax.compression import scoring
    from kvjax.methods.asl import layerwise

    q, k, valid = score_case(5, 2, 4, 2, 8, 77, 16, 9, jnp.float32)
    for pooling, kernel in (("avg", 5), ("max", 7)):
        lw = layerwise.head_window_scores(q, k, valid, 8, kernel, pooling)  # [B, K, G, P], sum
        for gqa, red in (("sum", jnp.sum), ("mean", jnp.mean)):
            ours = pallas.window_scores(q, k, valid, window=8, kernel=kernel, pooling=pooling,
                                        gqa=gqa, reduce="sum", implementation="xla")
            np.testing.assert_allclose(ours, red(lw, axis=2), rtol=1e-6, atol=1e-7)
        ours = pallas.window_scores(q, k, valid, window=8, kernel=kernel, pooling=pooling,
                                    gqa="max", reduce="mean", implementation="xla")
        np.testing.assert_array_equal(ours, scoring.snap_scores(q, k, valid, 8, kernel, pooling,
                                                                "max", "mean"))


# ---- decode attention ------------------------------------------------------------------

MODES = ("none", "one", "all", "random", "front")


def decode_case(seed, B, G, K, S, D, modes, dtype):
    q = normal(seed, (B, K * G, D), dtype, 2.0)
    k = normal(seed + 1, (B, K, S, D), dtype)
    v = normal(seed + 2, (B, K, S, D), dtype)
    rng = np.random.default_rng(seed)
    ok = np.zeros((B, K, S), bool)
    for i, mode in enumerate(modes[: B * K]):
        b, h = divmod(i, K)
        if mode == "one":
            ok[b, h, rng.integers(S)] = True
        elif mode == "all":
            ok[b, h] = True
        elif mode == "random":
            ok[b, h] = rng.random(S) < 0.3
        elif mode == "front":  # compacted head plus decoded tokens at the end
            ok[b, h, : rng.integers(1, S)] = True
            ok[b, h, S - 2:] = True
    return q, k, v, jnp.asarray(ok)


decode_params = st.fixed_dictionaries(dict(
    seed=st.integers(0, 1000), B=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 4, 8]),
    K=st.sampled_from([1, 2]), S=st.integers(10, 700), splits=st.sampled_from([1, 2, 3]),
    modes=st.lists(st.sampled_from(MODES), min_size=4, max_size=4)))


def decode_reference(q, k, v, ok):
    """The xla reference; 16-bit inputs one (element, KV head) at a time, because XLA:CPU
    has no BF16 x BF16 -> F32 batched dot (`attention.attend` fails there when B * K > 1)."""
    if q.dtype == jnp.float32:
        return decode_xla.decode_attention(q, k, v, ok)
    B, K = k.shape[:2]
    G = q.shape[1] // K
    return jnp.stack([jnp.concatenate([
        decode_xla.decode_attention(q[b:b + 1, h * G:(h + 1) * G], k[b:b + 1, h:h + 1],
                                    v[b:b + 1, h:h + 1], ok[b:b + 1, h:h + 1])[0]
        for h in range(K)]) for b in range(B)])


def check_decode(fn, p, D, tile, dtype, atol):
    S = ragged(p["S"], tile)
    modes = ["none", "one", "all"] + p["modes"] if p["seed"] % 2 else p["modes"]
    q, k, v, ok = decode_case(p["seed"], p["B"], p["G"], p["K"], S, D, modes, dtype)
    ref = decode_reference(q, k, v, ok)
    out = fn(q, k, v, ok, tile=tile, splits=p["splits"], interpret=True)
    assert out.dtype == q.dtype and not bool(jnp.isnan(out).any())
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=atol, rtol=0)
    dead = ~np.asarray(ok).any(-1)  # [B, K]: all-masked heads give zeros
    G = p["G"]
    out = np.asarray(out, np.float32).reshape(p["B"], p["K"], G, D)
    np.testing.assert_array_equal(out[dead], 0)


@FAST
@given(decode_params)
def test_decode_attention_tpu_interpret(p):
    check_decode(decode_tpu.decode_attention, p, 32, 128, jnp.float32, 2e-5)


def test_decode_attention_tpu_interpret_bf16():
    p = dict(seed=7, B=2, G=4, K=2, S=300, splits=2, modes=["random", "front", "all", "one"])
    check_decode(decode_tpu.decode_attention, p, 64, 128, jnp.bfloat16, 1 / 64)


@pytest.mark.slow
@SLOW
@given(decode_params, st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_decode_attention_tpu_interpret_wide(p, dtype):
    check_decode(decode_tpu.decode_attention, p, 64, 128, dtype,
                 2e-5 if dtype == jnp.float32 else 1 / 64)


def test_decode_attention_gpu_interpret():
    # bf16 only: the device kernel's P @ V takes 16-bit V (`pallas_gpu.reason`)
    p = dict(seed=11, B=1, G=4, K=2, S=200, splits=2, modes=["none", "one", "random", "front"])
    check_decode(decode_gpu.decode_attention, p, 64, 64, jnp.bfloat16, 1 / 64)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(decode_params)
def test_decode_attention_gpu_interpret_wide(p):
    check_decode(decode_gpu.decode_attention, p, 64, 64, jnp.bfloat16, 1 / 64)


def test_decode_reference_is_attend_and_never_nan():
    q, k, v, ok = decode_case(3, 2, 2, 2, 50, 16, ["none", "one", "all", "random"], jnp.float32)
    out = pallas.decode_attention(q, k, v, ok, implementation="xla")
    ref = attention.attend(q[:, None], k, v, ok[:, :, None])[:, 0]
    np.testing.assert_array_equal(out, ref)
    assert not bool(jnp.isnan(out).any()) and float(jnp.abs(out[0, :2]).max()) == 0.0


# ---- compaction ------------------------------------------------------------------------

def compact_case(seed, B, K, T, S, D, dtype):
    rng = np.random.default_rng(seed)
    k = normal(seed, (B, K, T, D), dtype)
    v = normal(seed + 1, (B, K, T, D), dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 3, (B, K, T))
    idx = np.stack([np.sort(rng.permutation(T)[:S]) for _ in range(B * K)]).reshape(B, K, S)
    count = rng.integers(0, S + 1, (B, K))
    count.flat[0], count.flat[-1] = 0, S  # a head keeping nothing, one keeping everything
    if B * K > 2:
        count.flat[1] = 1
    return k, v, pos, jnp.asarray(idx, jnp.int32), jnp.asarray(count, jnp.int32)


compact_params = st.fixed_dictionaries(dict(
    seed=st.integers(0, 1000), B=st.sampled_from([1, 2]), K=st.sampled_from([1, 2, 4]),
    T=st.integers(20, 200), frac=st.floats(0.1, 1.0)))


def check_compact(fn, p, D, rows, dtype):
    T = p["T"]
    S = ragged(max(1, int(T * p["frac"])), rows)
    S = min(S, T)
    args = compact_case(p["seed"], p["B"], p["K"], T, S, D, dtype)
    ref = compact_xla.compact(*args)
    out = fn(*args, rows=rows, interpret=True)
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=3, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(compact_params)
def test_compact_tpu_interpret(p):
    check_compact(compact_tpu.compact, p, 32, 8, jnp.float32)


def test_compact_tpu_interpret_bf16():
    check_compact(compact_tpu.compact, dict(seed=4, B=2, K=2, T=150, frac=0.4), 64, 16,
                  jnp.bfloat16)


def test_compact_gpu_interpret():
    check_compact(compact_gpu.compact, dict(seed=5, B=1, K=4, T=120, frac=0.3), 128, 16,
                  jnp.bfloat16)


def test_compact_reference_matches_layerwise_selection():
    """Indices from `top_with_window` (top_k, sorted) gathered like the layer-wise path."""
    from kvjax.compression.cache import take_slots as gather
    from kvjax.compression.selection import top_with_window

    B, K, T, D, S, w = 1, 2, 60, 8, 20, 4
    k, v, pos, _, _ = compact_case(0, B, K, T, S, D, jnp.float32)
    s = normal(9, (B, K, T - w))
    idx = jax.vmap(jax.vmap(lambda x: top_with_window(x, S, w)))(s)
    out = pallas.compact(k, v, pos, idx, jnp.full((B, K), S, jnp.int32), implementation="xla")
    np.testing.assert_array_equal(out[0], gather(k, idx))
    np.testing.assert_array_equal(out[2], gather(pos, idx))
    assert bool(out[3].all())


# ---- projected value norms ---------------------------------------------------------------

def norms_case(seed, B, K, G, T, Dh, M, dtype):
    return normal(seed, (B, K, T, Dh), dtype), normal(seed + 1, (K * G * Dh, M), dtype, 0.1)


norms_params = st.fixed_dictionaries(dict(
    seed=st.integers(0, 1000), B=st.sampled_from([1, 2]), K=st.sampled_from([1, 2]),
    G=st.sampled_from([1, 2, 4, 8]), T=st.integers(5, 400), M=st.sampled_from([128, 384])))


def check_norms(fn, p, Dh, tile, dtype, rtol):
    v, o = norms_case(p["seed"], p["B"], p["K"], p["G"], p["T"], Dh, p["M"], dtype)
    ref = norms_xla.value_norms(v, o)
    kw = dict(hidden=tile) if fn is norms_gpu.value_norms else dict(tile=tile)
    out = fn(v, o, **kw, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=rtol)


@settings(max_examples=2, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(norms_params)
def test_value_norms_tpu_interpret(p):
    check_norms(norms_tpu.value_norms, p, 32, 128, jnp.float32, 1e-5)


def test_value_norms_gpu_interpret():
    check_norms(norms_gpu.value_norms, dict(seed=1, B=1, K=2, G=2, T=100, M=256), 64, 128,
                jnp.bfloat16, 1e-5)


def test_value_norms_reference():
    """Equal to the dense definition, and to projected_norms' reference when present."""
    v, o = norms_case(2, 2, 2, 4, 37, 8, 24, jnp.float32)
    out = pallas.value_norms(v, o, block=16, implementation="xla")
    B, K, T, Dh = v.shape
    dense = jnp.einsum("bhtd,hdm->bhtm", jnp.repeat(v, 4, axis=1), o.reshape(K * 4, Dh, -1),
                       precision=jax.lax.Precision.HIGHEST)
    dense = jnp.abs(dense).sum(-1).reshape(B, K, 4, T).mean(2)
    np.testing.assert_allclose(out, dense, rtol=1e-6)
    critical = pytest.importorskip("kvjax.methods.critical.projected_norms")
    np.testing.assert_allclose(out, critical.projected_value_norms(v, o, 16), rtol=1e-6)



def test_value_norms_reference_bf16_sums_exact_products():
    """bf16 inputs multiply as they are with fp32 accumulation: the products of two bf16
    values are exact in fp32, so the result equals upcasting first and multiplying at fp32
    HIGHEST, up to the order of the fp32 sums (rtol 1e-5, about 100 fp32 ulps)."""
    v, o = norms_case(3, 1, 2, 4, 40, 8, 96, jnp.bfloat16)
    out = pallas.value_norms(v, o, block=16, implementation="xla")
    up = pallas.value_norms(v.astype(jnp.float32), o.astype(jnp.float32), block=16,
                            implementation="xla")
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, up, rtol=1e-5)

# ---- lowering for the devices (no device needed) -----------------------------------------

def lower(fn, platform, *shapes):
    exp = jax.export.export(jax.jit(fn), platforms=[platform])(
        *(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
    text = exp.mlir_module()
    target = "tpu_custom_call" if platform == "tpu" else "mosaic_gpu"
    assert target in text
    return exp


BF = jnp.bfloat16
LOWERINGS = {
    "window_scores": (
        [((1, 4000, 32, 128), BF), ((1, 8, 4000, 128), BF), ((1, 4000), bool)],
        lambda m: functools.partial(m.window_scores, window=32, kernel=7, pooling="max",
                                    gqa="mean", reduce="mean")),
    "decode_attention": (
        [((2, 32, 128), BF), ((2, 8, 5000, 128), BF), ((2, 8, 5000, 128), BF),
         ((2, 8, 5000), bool)],
        lambda m: m.decode_attention),
    "compact": (
        [((1, 8, 5000, 128), BF), ((1, 8, 5000, 128), BF), ((1, 8, 5000), jnp.int32),
         ((1, 8, 1024), jnp.int32), ((1, 8), jnp.int32)],
        lambda m: m.compact),
    "value_norms": ([((1, 8, 5000, 128), BF), ((32 * 128, 4096), BF)], lambda m: m.value_norms),
}
MODULES = {
    ("window_scores", "tpu"): scores_tpu, ("window_scores", "cuda"): scores_gpu,
    ("decode_attention", "tpu"): decode_tpu, ("decode_attention", "cuda"): decode_gpu,
    ("compact", "tpu"): compact_tpu, ("compact", "cuda"): compact_gpu,
    ("value_norms", "tpu"): norms_tpu, ("value_norms", "cuda"): norms_gpu,
}


@pytest.mark.parametrize("op, platform", sorted(MODULES))
def test_lowers(op, platform):
    """Pallas -> Mosaic TPU / Mosaic GPU lowering runs here; compiling the Mosaic module
    (layouts, VMEM/SMEM fit, ptxas) needs the device."""
    shapes, fn = LOWERINGS[op]
    lower(fn(MODULES[op, platform]), platform, *shapes)


def test_window_scores_lowers_fp32():
    _, fn = LOWERINGS["window_scores"]
    shapes = [((1, 3000, 32, 128), jnp.float32), ((1, 8, 3000, 128), jnp.float32),
              ((1, 3000), bool)]
    lower(fn(scores_tpu), "tpu", *shapes)
    lower(fn(scores_gpu), "cuda", *shapes)



@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", ["snapkv", "critical_snapkv", "asl", "lava"])
def test_engine_programs_lower(name, platform):
    """The engine's compiled prefill and decode, with every kernel op on the platform's
    Pallas kernel, lower for that platform (bf16, head dim 128): what a kernel lowers to
    alone it must also lower to inside the programs that call it. The prompt's attention
    stays on xla: cuDNN's lowering looks for a local cuDNN."""
    from kvjax import methods
    from kvjax.config import ModelConfig
    from kvjax.engine import steps
    from kvjax.engine.sampling import Sampling
    from kvjax.train import init_params

    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=256, intermediate_size=256,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,))
    params = jax.eval_shape(lambda: jax.tree.map(lambda x: x.astype(BF),
                                                 init_params(cfg, jax.random.PRNGKey(0))))
    impl = {"cuda": "pallas_gpu", "tpu": "pallas_tpu"}[platform]
    kern = pallas.Kernels(**{op: impl for op in pallas.OPS}, prefill_attention="xla")
    method = methods.create(name).with_budget(256)
    T = 1024
    cap = method.decode_capacity(method.cache_slots(T, cfg), 8, 0)
    tok, val = jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1, T), bool)

    def prefill(p, t, v):
        return steps.prefill(p, t, v, cfg=cfg, method=method, capacity=cap, kernels=kern)

    def decode(p, c, lg, r, st):
        return steps.decode(p, c, lg, r, st, cfg=cfg, method=method, max_new=8,
                            sampling=Sampling(), stop_ids=(2,), kernels=kern)

    target = "tpu_custom_call" if platform == "tpu" else "mosaic_gpu"
    exp = jax.export.export(jax.jit(prefill), platforms=[platform])(params, tok, val)
    assert target in exp.mlir_module()
    logits, cache, state, _ = jax.eval_shape(prefill, params, tok, val)
    exp = jax.export.export(jax.jit(decode), platforms=[platform])(
        params, cache, logits, jax.ShapeDtypeStruct((2,), jnp.uint32), state)
    assert target in exp.mlir_module()

# ---- dispatch ----------------------------------------------------------------------------

def test_dispatch_defaults_and_fallback():
    assert pallas.Kernels() == pallas.Kernels.every("auto")
    if jax.default_backend() == "cpu":
        assert pallas.resolve(None)[0] == "xla" and not pallas.Kernels().active("compact")
        assert pallas.resolve("pallas")[:2] == ("pallas_tpu", True)
        assert pallas.Kernels.every("pallas").resolved()["compact"] == "pallas_tpu (interpreted)"
    with pytest.raises(ValueError, match="triton"):
        pallas.Kernels.every("triton")
    # a kernel that cannot take the inputs: `auto` falls back, a name raises
    q, k, v, ok = decode_case(0, 1, 2, 1, 40, 8, ["all"], jnp.float32)
    if pallas.backend_pallas() is None:  # `auto` picks xla here: the explicit name must raise
        np.testing.assert_array_equal(pallas.decode_attention(q, k, v, ok, implementation="auto"),
                                      decode_xla.decode_attention(q, k, v, ok))
    with pytest.raises(ValueError, match="cannot run"):
        pallas.decode_attention(q, k, v, ok, implementation="pallas_gpu")  # D * 4 < 128 bytes
    with pallas.recording() as used:  # which implementation each op call took
        pallas.decode_attention(q, k, v, ok, implementation="xla")
    assert used == {("decode_attention", "xla")}


def test_engine_routes_decode_to_the_op():
    """One-query attention over the cache goes to the `decode_attention` op when the run's
    kernels pick a Pallas kernel (the dense attention otherwise)."""
    from kvjax.engine.layers import attend_cached

    q, k, v, ok = decode_case(4, 1, 4, 2, 300, 32, ["random", "front"], jnp.float32)
    ref = attention.attend(q[:, None], k, v, ok[:, :, None])
    interp = pallas.Kernels.every("pallas")  # interpreted TPU kernel on CPU
    jaxpr = str(jax.make_jaxpr(lambda *a: attend_cached(*a, interp))(q[:, None], k, v,
                                                                     ok[:, :, None]))
    out = attend_cached(q[:, None], k, v, ok[:, :, None], interp)
    assert "decode_attention" in jaxpr
    assert "decode_attention" not in str(jax.make_jaxpr(lambda *a: attend_cached(
        *a, pallas.Kernels.every("xla")))(q[:, None], k, v, ok[:, :, None]))
    np.testing.assert_allclose(out, ref, atol=2e-5)


def test_run_has_kernels_flag():
    from kvjax.cli.args import parse_args

    assert parse_args([]).kernels == "auto"
    assert parse_args(["--kernels", "pallas"]).kernels == "pallas"
    with pytest.raises(SystemExit):
        parse_args(["--kernels", "cuda"])


# ---- the methods keep the same entries with either implementation --------------------------


def kept_sets(method, kind, cfg, params, tokens, valid):
    """(pos, valid) of the compressed cache, the program traced with every op on `kind`
    (the choice is a static argument: part of the compile key)."""
    from kvjax.engine import compress_prompt, positions

    kernels = pallas.Kernels.every(kind)
    fn = jax.jit(lambda p, t, v: compress_prompt(
        method, p, cfg, t, v, positions(v, jnp.zeros((t.shape[0],), jnp.int32)), kernels)[1])
    kv = fn(params, tokens, valid)
    return np.asarray(kv.pos), np.asarray(kv.valid)


KEPT_CASES = [
    ("snapkv", dict(budget=48, window=8)),
    ("ada_snapkv", dict(budget=48, window=8)),  # compact with per-head counts
    ("asl", dict(select_k=48, window=8, layer_of_32=16, budget=48)),
    ("critical_snapkv", dict(budget=48, window=8)),
]


def assert_same_kept(name, overrides, cfg, params, tokens, valid):
    from kvjax import methods

    method = methods.create(name, **overrides)
    pos_x, val_x = kept_sets(method, "xla", cfg, params, tokens, valid)
    pos_p, val_p = kept_sets(method, "pallas", cfg, params, tokens, valid)
    np.testing.assert_array_equal(val_p, val_x)
    np.testing.assert_array_equal(np.where(val_p, pos_p, -1), np.where(val_x, pos_x, -1))


@pytest.mark.parametrize("name, overrides", KEPT_CASES)
def test_methods_keep_the_same_entries(name, overrides):
    """SnapKV and AdaKV (window scores, compaction), ASL (layer-wise window scores) and
    CriticalKV (window scores and projected value norms) on a random 2-layer model: the
    interpreted Pallas kernels (`--kernels pallas` on CPU) keep exactly the entries the
    xla references keep."""
    from kvjax.config import ModelConfig
    from kvjax.train import init_params

    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=64, intermediate_size=64,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 150), 3, cfg.vocab_size)
    valid = jnp.ones((2, 150), bool).at[1, :20].set(False)  # element 1 left-padded
    assert_same_kept(name, overrides, cfg, params, tokens, valid)


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", KEPT_CASES)
def test_methods_keep_the_same_entries_on_the_bundled_model(name, overrides):
    """The same on the bundled model and a real task prompt (interpreted kernels: slow)."""
    import kvjax

    model = kvjax.load("tiny-retrieval")
    s = kvjax.tasks.generate("niah_multikey", context_length=256, n=1, seed=0)[0]
    tokens = jnp.asarray([model.encode(s.prompt)])
    valid = jnp.ones(tokens.shape, bool)
    assert_same_kept(name, overrides, model.cfg, model.params, tokens, valid)


def test_auto_falls_back_to_xla_when_a_kernel_fails_to_compile(monkeypatch):
    """A Pallas kernel `auto` picked that fails to lower on the running backend (here the
    Mosaic TPU compaction, not interpreted, on CPU) becomes the xla reference with one
    warning naming the op; the run's tokens are xla's; the same kernel named explicitly
    raises."""
    from kvjax import engine, methods
    from kvjax.config import ModelConfig
    from kvjax.pallas import dispatch
    from kvjax.train import init_params

    if jax.default_backend() != "cpu":
        pytest.skip("forces a TPU kernel onto the CPU backend")
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    ids = [list(np.random.default_rng(0).integers(3, 64, 150))]
    m = methods.create("snapkv", budget=48, window=8)
    want = engine.run(params, cfg, ids, m, max_new_tokens=4, stop_ids=())
    monkeypatch.setattr(dispatch, "backend_pallas", lambda: "pallas_tpu")
    monkeypatch.setattr(dispatch, "MEASURED_FASTER", {("tpu", "compact")})
    assert pallas.Kernels().resolved()["compact"] == "pallas_tpu"
    engine.clear_compiled()
    with pytest.warns(RuntimeWarning, match="compact"):
        got = engine.run(params, cfg, ids, m, max_new_tokens=4, stop_ids=())
    assert got.tokens == want.tokens and got.stats["kernels"]["compact"] == "xla"
    with pytest.raises(Exception):
        engine.run(params, cfg, ids, m, max_new_tokens=4, stop_ids=(),
                   kernels=pallas.Kernels(compact="pallas_tpu"))
