"""HeadKV, critical_headkv and critical_lava (issue 9).

- the budget formula against the authors' per-query-head code written out in numpy;
- kept sets through the real prefill against plain numpy: headkv (window + top b_h - w by
  SnapKV's score), critical_headkv and critical_lava (||V W_O^h||_1 and the two stages in
  numpy; the base scores and LAVa's per-head counts are captured from the model);
- invariants: budget per head and in total, window kept, no padding kept, kept slots hold
  the original k/v and positions, live slots first in ascending position order;
- errors: a model without scores, a named model without a file, a file for another model;
- the bundled head-score file belongs to the bundled weights; end-to-end CLI runs.
"""

from __future__ import annotations

import json
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import engine, methods
from kvjax.engine import layers
from kvjax.methods.baselines import head_scores as headkv
from kvjax.methods.lava.entropy import lava_scores
from kvjax.models import checkpoint

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")

N, W = 128, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """3-layer GQA-4 random model, a 128-token context, a random head-score file."""
    from kvjax.models.checkpoint import load_hf

    model = hf_models.build("llama_llama3rope_gqa4", layers=3)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        cfg, params = load_hf(d)
    rng = np.random.default_rng(5)
    ctx = rng.integers(3, cfg.vocab_size, size=(1, N))
    scores = rng.random((cfg.num_layers, cfg.num_heads)) ** 3  # skewed, as real scores are
    path = tmp_path_factory.mktemp("scores") / "tiny.json"
    path.write_text(json.dumps({"config": cfg.to_hf(), "head_scores": scores.tolist()}))
    return cfg, params, ctx, scores, str(path)


# ---- numpy references -----------------------------------------------------------------

def np_budgets(scores, budget, window, beta, temp, K):
    """The authors' per-query-head capacities (ReasonSnapKVCluster), unrounded, then the
    mean over each KV head's query heads (kvjax keeps one cache per KV head)."""
    L, H = scores.shape
    p = scores.reshape(-1) / scores.sum()
    p = p**temp / np.sum(p**temp)
    base = budget - window
    pool = (base // beta) * L * H
    cap = p.reshape(L, H) * pool + (base - base // beta)
    return cap.reshape(L, K, H // K).mean(-1)


def np_proj_norm(v, wo):
    """v [K, T, Dh], wo [H*Dh, D] -> [K, T]: mean over each group of sum_e |v W_O^h|."""
    K, T, Dh = v.shape
    H = wo.shape[0] // Dh
    out = np.zeros((K, T))
    for h in range(H):
        out[h // (H // K)] += np.abs(v[h // (H // K)].astype(np.float64)
                                     @ wo[h * Dh:(h + 1) * Dh]).sum(-1)
    return out / (H // K)


def np_topk(s, b):
    """The b best indices of s (ties: lower index), as a set."""
    return set(sorted(range(len(s)), key=lambda i: (-s[i], i))[:b])


def np_two_stage(s, norm, b, ratio=0.5, eps=1e-4):
    """CriticalKV Algorithm 1 for one head; s has the window at +inf, padding -inf."""
    first = np_topk(s, max(1, int(b * ratio))) | {i for i in range(len(s)) if s[i] == np.inf}
    rest = [i for i in range(len(s)) if i not in first and np.isfinite(s[i])]
    rest.sort(key=lambda i: (-(s[i] + eps) * norm[i], i))
    return first | set(rest[: b - len(first)])


# ---- helpers ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def caps(tiny):
    """Per layer (batch element 0, one compiled pass): SnapKV scores [K, T] (as headkv's),
    LAVa Eq. 5 prefix scores [K, P], v [K, T, Dh], W_O, k [K, T, Dh]."""
    cfg, params, ctx, *_ = tiny
    snap = methods.create("snapkv", budget=24, window=W)
    lava = methods.create("lava", budget=24, window=W)
    tokens = jnp.asarray(ctx)
    valid = jnp.ones(ctx.shape, bool)
    pos = engine.positions(valid, jnp.zeros((1,), jnp.int32))

    def hook(io, st):
        lv = lava_scores(io, W, lava.kernel, lava.pooling)
        return (snap.scores(io)[0], lv[0], io.v[0], io.wo, io.k[0]), st
    _, out, _ = layers.prefill_layers(params, cfg, tokens, valid, pos, hook)
    return dict(zip(("snap", "lava", "v", "wo", "k"), (np.asarray(a) for a in out)))


def prefill(cfg, params, method, prompts):
    T = max(map(len, prompts))
    tokens, valid = engine.pad_left(prompts, T, cfg.pad_token_id)
    for p in prompts:
        method.validate(len(p), cfg)
    _, cache, _, stats = engine.prefill(params, tokens, valid, cfg=cfg, method=method,
                                        capacity=method.cache_slots(T, cfg))
    return cache, stats


def kept_sets(cache, b=0):
    pos, live = np.asarray(cache.pos[:, b]), np.asarray(cache.valid[:, b])
    return [[set(pos[l, h][live[l, h]].tolist()) for h in range(pos.shape[1])]
            for l in range(pos.shape[0])]


# ---- budgets ---------------------------------------------------------------------------

@pytest.mark.parametrize("budget,beta,temp", [(40, 1.005, 1.0), (40, 1.5, 1.0), (64, 5, 2.0),
                                              (9, 1.005, 1.0)])
def test_budget_table_formula(budget, beta, temp):
    rng = np.random.default_rng(budget)
    L, H, K = 5, 8, 2
    s = rng.random((L, H)) ** 2
    t = headkv.budget_table(s, budget, W, beta, temp, K)
    ref = np_budgets(s, budget, W, beta, temp, K)
    assert t.shape == (L, K) and t.dtype == np.int32
    assert np.all(np.abs(t - W - ref) <= 0.5 + 1e-9)  # one rounding per head
    assert np.all(t >= W)  # every head keeps at least its window
    assert abs(int(t.sum()) - L * K * budget) <= L * K / 2  # the total, up to rounding
    # MHA: exactly the authors' integers (torch.round is half to even, as np.round)
    t1 = headkv.budget_table(s, budget, W, beta, temp, H)
    assert np.array_equal(t1 - W, np.round(np_budgets(s, budget, W, beta, temp, H)))


def test_budget_table_zero_scores_are_uniform():
    t = headkv.budget_table(np.zeros((3, 4)), 40, W, 1.005, 1.0, 2)
    assert np.all(t == 40)


# ---- errors ----------------------------------------------------------------------------

def test_missing_scores_error_names_model_and_file(tiny):
    cfg, params, ctx, *_ = tiny
    with pytest.raises(FileNotFoundError) as e:
        methods.create("headkv", budget=40, window=W).validate(N, cfg)
    msg = str(e.value)
    assert headkv.describe(cfg) in msg and str(headkv.SCORES_DIR) in msg
    assert "python -m kvjax.headkv_scores" in msg and "head_scores=" in msg
    with pytest.raises(FileNotFoundError, match="no-such-model.json"):
        methods.create("critical_headkv", budget=40, window=W,
                       head_scores="no-such-model").validate(N, cfg)
    # through the engine: fails before tracing
    with pytest.raises(FileNotFoundError, match="headkv: no head scores"):
        engine.run(params, cfg, [list(ctx[0])], methods.create("headkv", budget=40, window=W))


def test_scores_for_another_model_rejected(tiny):
    cfg, *_ = tiny
    with pytest.raises(ValueError, match="another model"):
        methods.create("headkv", budget=40, window=W,
                       head_scores="tiny-retrieval").validate(N, cfg)


def test_bad_parameters(tiny):
    cfg, *_, path = tiny
    for bad, match in ((dict(beta=0.5), "beta"), (dict(temp=0.0), "temp"),
                       (dict(budget=W), "budget")):
        with pytest.raises(ValueError, match=match):
            methods.create("headkv", **{"budget": 40, "window": W, "head_scores": path,
                                        **bad}).validate(N, cfg)


# ---- kept sets vs numpy, invariants --------------------------------------------------------

def test_headkv_kept_sets_and_invariants(tiny, caps):
    """Element 0 (no padding): kept sets vs numpy, per-head and total budgets, window,
    slots; element 1 (48 tokens, left-padded): budgets clamped, no padding kept."""
    cfg, params, ctx, scores, path = tiny
    m = methods.create("headkv", budget=24, window=W, head_scores=path)
    b = headkv.budget_table(scores, 24, W, m.beta, m.temp, cfg.num_kv_heads)
    cache, stats = prefill(cfg, params, m, [list(ctx[0]), list(ctx[0][:48])])
    kept = kept_sets(cache)
    assert cache.pos.shape[3] == b.max()  # static slots: the largest head budget
    for l in range(cfg.num_layers):
        for h in range(cfg.num_kv_heads):
            assert len(kept[l][h]) == b[l, h]  # budget respected per head
            assert set(range(N - W, N)) <= kept[l][h]  # window kept
            assert kept[l][h] == np_topk(caps["snap"][l, h], int(b[l, h])), (l, h)
            # masks consistent: live slots first, ascending, holding the original k
            live = np.asarray(cache.valid[l, 0, h])
            n_live = int(live.sum())
            assert live[:n_live].all() and not live[n_live:].any()
            p = np.asarray(cache.pos[l, 0, h])[:n_live]
            assert np.all(np.diff(p) > 0)
            np.testing.assert_array_equal(np.asarray(cache.k[l, 0, h])[:n_live],
                                          caps["k"][l, h][p])
            short = np.asarray(cache.pos[l, 1, h])[np.asarray(cache.valid[l, 1, h])]
            assert len(short) == min(b[l, h], 48)
            assert short.min() >= 0 and short.max() < 48  # original positions, no padding
    assert np.asarray(stats["layer_budgets"])[0].sum() == b.sum()  # total respected


def test_critical_headkv_matches_numpy(tiny, caps):
    cfg, params, ctx, scores, path = tiny
    m = methods.create("critical_headkv", budget=24, window=W, head_scores=path)
    s, v, wo = caps["snap"], caps["v"], caps["wo"]
    b = headkv.budget_table(scores, 24, W, m.base.beta, m.base.temp, cfg.num_kv_heads)
    kept = kept_sets(prefill(cfg, params, m, [list(ctx[0])])[0])
    for l in range(cfg.num_layers):
        norm = np_proj_norm(v[l], wo[l])
        for h in range(cfg.num_kv_heads):
            assert kept[l][h] == np_two_stage(s[l, h], norm[h], int(b[l, h])), (l, h)


@pytest.mark.parametrize("cascade", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_critical_lava_matches_numpy(tiny, caps, cascade):
    """LAVa's per-head counts, CriticalKV's choice: counts equal plain LAVa's, kept sets
    equal the numpy two stages on LAVa's Eq. 5 score."""
    cfg, params, ctx, *_ = tiny
    kw = dict(budget=24, window=W, cascade=cascade)
    lava, crit = methods.create("lava", **kw), methods.create("critical_lava", **kw)
    s, v, wo = caps["lava"], caps["v"], caps["wo"]
    base = kept_sets(prefill(cfg, params, lava, [list(ctx[0])])[0])
    cache, stats = prefill(cfg, params, crit, [list(ctx[0])])
    kept = kept_sets(cache)
    differs = 0
    for l in range(cfg.num_layers):
        norm = np_proj_norm(v[l], wo[l])
        for h in range(cfg.num_kv_heads):
            b = len(base[l][h])
            assert len(kept[l][h]) == b  # LAVa decides how many
            full = np.concatenate([s[l, h], np.full(W, np.inf)])
            assert kept[l][h] == np_two_stage(full, norm[h], b), (l, h)
            differs += kept[l][h] != base[l][h]
    assert differs > 0  # the rule changed something at this budget
    assert sum(map(len, sum(kept, []))) == sum(map(len, sum(base, [])))


# ---- bundled model ---------------------------------------------------------------------------

def test_bundled_scores_match_bundled_weights():
    import kvjax.api

    data = json.loads((headkv.SCORES_DIR / "tiny-retrieval.json").read_text())
    want = checkpoint.weights_sha256(kvjax.api.BUNDLED_DIR / "tiny-retrieval")
    assert data["weights_sha256"] == want, (
        "kvjax/assets/head_scores/tiny-retrieval.json was computed for other weights than the "
        "bundled model's: run `python -m kvjax.headkv_scores --model tiny-retrieval`")


@pytest.mark.parametrize("path", sorted(p.name for p in headkv.SCORES_DIR.glob("*.json")
                                         if p.stem != "tiny-retrieval"))
def test_packaged_models_scores_match_their_weights(path):
    """Each real model's head scores (SmolLM2-135M, Qwen2.5-Coder-0.5B) were computed on the
    weights its packages install (skipped where they are not installed)."""
    from kvjax.models import packaged

    data = json.loads((headkv.SCORES_DIR / path).read_text())
    try:
        gguf = packaged.file(data["model"])
    except FileNotFoundError as e:
        pytest.skip(f"{data['model']} is not installed: {e}")
    assert data["weights_sha256"] == checkpoint.weights_sha256(gguf), (
        f"kvjax/assets/head_scores/{path} was computed for other weights: run `python -m "
        f"kvjax.headkv_scores --model {data['model']}`")
    s = np.asarray(data["head_scores"])
    assert s.shape == (data["config"]["num_hidden_layers"],
                       data["config"]["num_attention_heads"]) and np.all(s >= 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["headkv", "critical_headkv", "critical_lava"])
def test_cli_end_to_end(name, tmp_path):
    from kvjax import run

    out = tmp_path / "r.json"
    assert run.main(["--method", name, "--budget", "64", "--task", "niah_single", "--context",
                     "256", "--samples", "2", "--scenario", "context_only", "--no-progress",
                     "--output", str(out)]) == 0
    rec = json.loads(out.read_text())["records"][0]
    assert rec["method"] == name and rec["samples"] == 2
    # context-only: the live cache also holds the question, so a bit above 64 / 256
    assert 0 <= rec["accuracy"] <= 1 and rec["kv_fraction"] < 0.35
