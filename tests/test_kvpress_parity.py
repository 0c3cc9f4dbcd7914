"""Parity with NVIDIA kvpress 0.5.5 (PyTorch, fp32, CPU) on tiny random HF models.

Each press runs through kvpress's own API (`with press(model): model.model(context)`,
then the question on top with explicit positions, as its pipeline does) and the kvjax
method runs through `engine.prefill` + `engine.extend` (the context-only scenario), both
configured identically. Checked per (layer, KV head):

- the kept positions after prefill compression are the same set (kvpress's kept rows
  are located in the uncompressed cache -- compression does not change the hidden
  states, so they are bit-identical rows; AdaKV's kept set is the complement of its
  `masked_key_indices`). A mismatch is forgiven only where the swapped entries' scores
  differ by < 1e-6 relative (a float tie); none was needed when this was written;
- the logits of the question's last token from the two compressed caches agree within
  TOL = 2e-4 absolute (seen: 0.9e-5 to 2.8e-5 on logits of magnitude 10-50, the same as
  the uncompressed parity of tests/test_parity_hf.py; 1.4e-6 to 1.9e-6 on the bundled
  model). AdaKV and PyramidKV use a one-token question (a decode step): kvpress's AdaKV
  fake key cannot be found for a multi-token chunk of random queries, and transformers
  masks a multi-token chunk for layer 0's length when layers hold different lengths.

kvpress defaults overridden on both sides: window 64 -> 8 (the contexts are 128
tokens), kernel 5 and avg pooling kept (kvpress has avg only), GQA mean (kvpress's).
kvjax's `budget` B maps to kvpress's `compression_ratio` r with int(n (1 - r)) = B;
PyramidKV needs n (1 - r) = B exactly, and its per-layer budgets are compared too.
"""

from __future__ import annotations

import dataclasses
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress", reason="kvpress (test dependency) not importable")
hf_models = pytest.importorskip("hf_models")

from transformers import DynamicCache  # noqa: E402

from kvjax import engine, methods  # noqa: E402
from kvjax.compression import budgets  # noqa: E402
from kvjax.engine import layers  # noqa: E402
from kvjax.models.checkpoint import load_hf  # noqa: E402

TOL = 2e-4
TIE_REL = 1e-6
W = 8  # observation window on both sides
N_CTX, N_Q, BUDGET = 128, 6, 40  # 40/128 and 72/128 are exact in binary


@pytest.fixture(scope="module", params=[
    "llama_llama3rope_gqa4", pytest.param("qwen3_qknorm_gqa2", marks=pytest.mark.slow)])
def pair(request):
    model = hf_models.build(request.param, layers=3)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        cfg, params = load_hf(d)
    rng = np.random.default_rng(7)
    ctx = rng.integers(3, cfg.vocab_size, size=(1, N_CTX))
    q = rng.integers(3, cfg.vocab_size, size=(1, N_Q))
    return request.param, model, cfg, params, ctx, q


def _ratio(n: int, b: int) -> float:
    r = 1 - b / n
    assert kvpress.utils.compute_n_kept(n, r) == b and n * (1 - r) == b, (n, b, r)
    return r


def _press_run(model, press, ctx, q, attn="eager"):
    """kvpress: compressed cache's kept positions per (layer, head) and question logits."""
    for layer in model.model.layers:  # AdaKV leaves its mask on the modules
        layer.self_attn.masked_key_indices = None
    model.set_attn_implementation(attn)
    try:
        return _press_run_inner(model, press, ctx, q)
    finally:
        model.set_attn_implementation("eager")
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None


def _press_run_inner(model, press, ctx, q):
    n = ctx.shape[1]
    full = DynamicCache()
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=torch.tensor(ctx), past_key_values=full)
        with press(model):
            model.model(input_ids=torch.tensor(ctx), past_key_values=cache)
        kept = []
        for li, layer in enumerate(cache.layers):
            mod = model.model.layers[li].self_attn
            masked = getattr(mod, "masked_key_indices", None)
            K = layer.keys.shape[1]
            if masked is not None:  # AdaKV: rectangular cache, evicted keys masked
                keep = np.ones((K, n), bool)
                keep[masked[1].numpy(), masked[2].numpy()] = False
                kept.append([set(np.flatnonzero(keep[h]).tolist()) for h in range(K)])
                continue
            ck, fk = layer.keys[0], full.layers[li].keys[0]  # [K, S, D], [K, n, D]
            d = ((ck[:, :, None] - fk[:, None]) ** 2).sum(-1)
            assert d.min(-1).values.max().item() == 0.0  # every kept row is a prompt row
            kept.append([set(d[h].argmin(-1).tolist()) for h in range(K)])
        pos = torch.arange(n, n + q.shape[1])[None]
        logits = model(input_ids=torch.tensor(q), past_key_values=cache,
                       position_ids=pos).logits[0, -1].numpy()
    return kept, logits


def _ours(cfg, params, method, ctx, q):
    n = ctx.shape[1]
    tokens, valid = engine.pad_left([list(ctx[0])], n, cfg.pad_token_id)
    S = method.cache_slots(n, cfg)
    _, cache, state, stats = engine.prefill(params, tokens, valid, cfg=cfg, method=method,
                                            capacity=method.decode_capacity(S, q.shape[1], 0))
    pos, live = np.asarray(cache.pos[:, 0]), np.asarray(cache.valid[:, 0])
    kept = [[set(pos[l, h][live[l, h]].tolist()) for h in range(pos.shape[1])]
            for l in range(pos.shape[0])]
    qt, qv = engine.pad_left([list(q[0])], q.shape[1], cfg.pad_token_id)
    logits, _, _ = engine.extend(params, cache, qt, qv, state, cfg=cfg, method=method)
    return kept, np.asarray(logits[0]), stats


def _our_scores(cfg, params, method, ctx):
    """kvjax's own per-layer scores [L, K, n] (forced entries +inf), for tie checks."""
    tokens = jnp.asarray(ctx)
    valid = jnp.ones(ctx.shape, bool)
    pos = engine.positions(valid, jnp.zeros((1,), jnp.int32))
    _, s, _ = layers.prefill_layers(params, cfg, tokens, valid, pos,
                                  lambda io, st: (method.scores(io), st))
    return np.asarray(s[:, 0])


def _compare_sets(name, ours, theirs, get_scores, per_layer=False):
    """Kept sets equal, or every swap is a float tie (< 1e-6 relative)."""
    if ours == theirs:
        return 0
    scores = get_scores()
    bad, ties = [], 0
    for l, (ol, tl) in enumerate(zip(ours, theirs)):
        groups = [(range(len(ol)),)] if per_layer else [((h,),) for h in range(len(ol))]
        for (heads,) in groups:
            a = [(h, p) for h in heads for p in ol[h] - tl[h]]
            b = [(h, p) for h in heads for p in tl[h] - ol[h]]
            if not a and not b:
                continue
            sa = np.array([scores[l, h, p] for h, p in a])
            sb = np.array([scores[l, h, p] for h, p in b])
            both = np.concatenate([sa, sb])
            if (len(a) != len(b) or not np.isfinite(both).all()
                    or np.ptp(both) > TIE_REL * np.abs(both).max()):
                bad.append((l, list(heads), sorted(a), sorted(b)))
            ties += len(a)
    assert not bad, f"{name}: kept sets differ beyond ties: {bad[:3]}"
    return ties


CASES = {
    # name: (kvpress press factory(ratio), kvjax method, attention implementation, question
    # tokens). AdaKV needs sdpa (kvpress rejects eager) and a one-token question: its fake
    # key must make exp(q.k) = 0 for every query of the chunk, which kvpress's
    # `search_hyperplane` cannot find for 6 x 4 random queries in 16 dimensions.
    "snapkv": (lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=W, kernel_size=5),
               methods.SnapKV(budget=BUDGET, window=W, kernel=5, pooling="avg", gqa="mean"),
               "eager", N_Q),
    "snapkv_sdpa": (lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=W,
                                                  kernel_size=5),
                    methods.SnapKV(budget=BUDGET, window=W, kernel=5, pooling="avg"), "sdpa",
                    N_Q),
    "streaming_llm": (lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4),
                      methods.StreamingLLM(budget=BUDGET, n_sink=4), "eager", N_Q),
    "tova": (lambda r: kvpress.TOVAPress(compression_ratio=r), methods.TOVA(budget=BUDGET),
             "eager", N_Q),
    "observed_attention": (lambda r: kvpress.ObservedAttentionPress(compression_ratio=r),
                           methods.ObservedAttention(budget=BUDGET), "eager", N_Q),
    "ada_snapkv": (lambda r: kvpress.AdaKVPress(
        kvpress.SnapKVPress(compression_ratio=r, window_size=W, kernel_size=5),
        alpha_safeguard=0.2), methods.AdaSnapKV(budget=BUDGET, window=W, kernel=5,
                                                pooling="avg", alpha=0.2), "sdpa", 1),
    # a safeguard larger than the window: int(40 * 0.5) = 20 > 8 protects prefix entries
    "ada_snapkv_alpha0.5": (lambda r: kvpress.AdaKVPress(
        kvpress.SnapKVPress(compression_ratio=r, window_size=W, kernel_size=5),
        alpha_safeguard=0.5), methods.AdaSnapKV(budget=BUDGET, window=W, kernel=5,
                                                pooling="avg", alpha=0.5), "sdpa", 1),
}


SLOW_CASES = ("snapkv_sdpa",)  # kvpress's own window-attention path (sdpa): same kept sets


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES
                                  else c for c in sorted(CASES)])
def test_kept_sets_and_logits(pair, case):
    fam, model, cfg, params, ctx, q = pair
    make_press, method, attn, nq = CASES[case]
    q = q[:, :nq]
    theirs, ref = _press_run(model, make_press(_ratio(N_CTX, BUDGET)), ctx, q, attn)
    ours, logits, _ = _ours(cfg, params, method, ctx, q)
    ties = _compare_sets(f"{fam}/{case}", ours, theirs,
                         lambda: _our_scores(cfg, params, method, ctx),
                         per_layer=case.startswith("ada"))
    err = np.abs(logits - ref).max()
    print(f"{fam}/{case}: kept sets equal ({ties} tie swaps); logits max abs diff {err:.2e}")
    assert err < TOL, f"{fam}/{case}: logits max abs diff {err:.2e}"
    if case.startswith("ada"):  # masked budgets: K * B live per layer, heads differ
        assert all(sum(len(h) for h in layer) == cfg.num_kv_heads * BUDGET for layer in ours)


@pytest.mark.parametrize("budget", [40, 72])
def test_pyramidkv(pair, budget):
    """PyramidKV: per-layer budgets equal kvpress's `get_layer_budget`, kept sets and logits.

    Window 2 so that beta 20 leaves the pyramid regime (min = B/20 >= window) at these
    budgets; budget 72 also hits the `max >= n - window` cap.
    """
    fam, model, cfg, params, ctx, q = pair
    n, w = ctx.shape[1], 2
    r = _ratio(n, budget)
    press = kvpress.PyramidKVPress(compression_ratio=r, window_size=w, kernel_size=5, beta=20)
    want = [press.get_layer_budget(model.model.layers[i].self_attn, n)
            for i in range(cfg.num_layers)]
    sched = budgets.pyramid(budget, n, cfg.num_layers, w, 20)
    assert list(sched) == want and len(set(want)) > 1, (sched, want)
    method = methods.PyramidKV(budget=budget, window=w, kernel=5, pooling="avg", beta=20)
    _check_pyramid(f"{fam}/pyramidkv b={budget}", pair, method, press, want)


def _check_pyramid(label, pair, method, press, want):
    """Our PyramidKV against kvpress's press: the layer budgets `want`, the kept sets (up to
    tie swaps) and the logits of one question token. Layers of different lengths:
    transformers builds the mask of a multi-token chunk (and eager's mask at all) for layer
    0's length, so one token on sdpa."""
    fam, model, cfg, params, ctx, q = pair
    theirs, ref = _press_run(model, press, ctx, q[:, :1], "sdpa")
    ours, logits, stats = _ours(cfg, params, method, ctx, q[:, :1])
    assert [len(layer[0]) for layer in ours] == want
    assert np.asarray(stats["layer_budgets"])[0, :, 0].tolist() == want
    ties = _compare_sets(label, ours, theirs, lambda: _our_scores(cfg, params, method, ctx))
    err = np.abs(logits - ref).max()
    print(f"{label}: layer budgets {want}, kept sets equal ({ties} tie swaps); logits max "
          f"abs diff {err:.2e}")
    assert err < TOL


def test_pyramidkv_at_a_ratio(pair):
    """`--ratio` where n (1 - r) is not an integer (128 x 0.4 = 51.2): kvpress keeps the
    float through the schedule, and so does `PyramidKV.with_ratio` -- layer budgets, kept
    sets and logits as kvpress's; the integer budget 51 gives other layer budgets."""
    fam, model, cfg, params, ctx, q = pair
    n, w, r = ctx.shape[1], 2, 0.6
    press = kvpress.PyramidKVPress(compression_ratio=r, window_size=w, kernel_size=5, beta=20)
    want = [press.get_layer_budget(model.model.layers[i].self_attn, n)
            for i in range(cfg.num_layers)]
    base = methods.PyramidKV(window=w, kernel=5, pooling="avg", beta=20)
    assert list(budgets.pyramid(int(n * (1 - r)), n, cfg.num_layers, w, 20)) != want
    _check_pyramid(f"{fam}/pyramidkv r={r}", pair, base.with_ratio(r, n), press, want)


def test_budget_equal_context_is_full(pair):
    """SnapKV keeping every entry (budget = n) gives exactly the uncompressed logits."""
    fam, model, cfg, params, ctx, q = pair
    n = ctx.shape[1]
    full_kept, full_logits, _ = _ours(cfg, params, methods.Method(), ctx, q)
    ours, logits, _ = _ours(cfg, params, methods.SnapKV(budget=n, window=W), ctx, q)
    assert ours == full_kept
    np.testing.assert_array_equal(logits, full_logits)
    assert dataclasses.replace(methods.SnapKV(), budget=n).kept_slots(n) == n


@pytest.fixture(scope="module")
def bundled():
    """The bundled model in kvjax and in HF transformers (fp32), from the same files."""
    import kvjax.api

    path = kvjax.api.BUNDLED_DIR / "tiny-retrieval"
    if not (path / "config.json").exists():
        pytest.skip("the bundled model is not in this checkout")
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return kvjax.load("tiny-retrieval"), hf


@pytest.mark.slow
@pytest.mark.parametrize("case", ["snapkv", "ada_snapkv", "tova", "streaming_llm"])
def test_bundled_model(case, bundled):
    """The bundled model on a real task prompt, kvpress's own defaults (window 64, avgpool
    5) at budget 128 of a ~1024-token context: kept sets and next-token logits."""
    from kvjax import tasks

    model, hf = bundled
    s = tasks.generate("niah_multikey", context_length=1024, n=1, seed=0)[0]
    ctx = np.array([model.encode(s.context)])
    q = np.array([model.encode(s.question, bos=False)])
    n, b = ctx.shape[1], 128
    r = 1 - b / n
    if kvpress.utils.compute_n_kept(n, r) != b:
        r = 1 - (b + 0.5) / n
    snap = lambda: kvpress.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5)
    press, method, attn = {
        "snapkv": (snap(), methods.SnapKV(budget=b, window=64, kernel=5, pooling="avg"),
                   "eager"),
        "ada_snapkv": (kvpress.AdaKVPress(snap()), methods.AdaSnapKV(
            budget=b, window=64, kernel=5, pooling="avg"), "sdpa"),
        "tova": (kvpress.TOVAPress(compression_ratio=r), methods.TOVA(budget=b), "eager"),
        "streaming_llm": (kvpress.StreamingLLMPress(compression_ratio=r),
                          methods.StreamingLLM(budget=b), "eager"),
    }[case]
    q = q[:, :1] if case == "ada_snapkv" else q
    theirs, ref = _press_run(hf, press, ctx, q, attn)
    ours, logits, _ = _ours(model.cfg, model.params, method, ctx, q)
    ties = _compare_sets(f"bundled/{case}", ours, theirs,
                         lambda: _our_scores(model.cfg, model.params, method, ctx),
                         per_layer=case.startswith("ada"))
    err = np.abs(logits - ref).max()
    print(f"bundled/{case}: kept sets equal ({ties} tie swaps); logits max abs diff {err:.2e}")
    assert err < TOL


def _press_greedy(model, press, ids, steps, stop):
    """kvpress compresses the whole prompt (question-aware), then HF decodes greedily one
    token at a time on the compressed cache, positions continuing at len(ids)."""
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            lg = model(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0, -1]
        out = []
        for t in range(steps):
            tok = int(lg.argmax())
            if tok in stop:
                break
            out.append(tok)
            lg = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                       position_ids=torch.tensor([[len(ids) + t]])).logits[0, -1]
    return out


def test_greedy_decode_after_compression(pair):
    """`engine.run` (question-aware SnapKV, then the jitted decode loop) generates the same
    8 greedy tokens as kvpress's compressed cache decoded step by step in HF: the decode
    path (appended slots, positions n + t, masks) agrees beyond the first token."""
    fam, model, cfg, params, ctx, q = pair
    ids = [int(t) for t in np.concatenate([ctx[0], q[0]])]
    n, b = len(ids), 40
    press = kvpress.SnapKVPress(compression_ratio=1 - b / n, window_size=W, kernel_size=5)
    assert kvpress.utils.compute_n_kept(n, 1 - b / n) == b
    theirs = _press_greedy(model, press, ids, 8, set(cfg.eos_token_ids))
    method = methods.SnapKV(budget=b, window=W, kernel=5, pooling="avg", gqa="mean")
    ours = engine.run(params, cfg, [ids], method, max_new_tokens=8).tokens[0]
    print(f"{fam}: {ours} vs {theirs}")
    assert ours == theirs and len(ours) > 1


@pytest.mark.slow
def test_bundled_model_greedy_answers(bundled):
    """The bundled model, niah_single at ~1024 tokens, SnapKV at budget 64 (kvpress's
    avgpool, window 32, kernel 7): kvjax's generated answers equal kvpress + HF greedy
    decoding token for token, wrong digits included (seen: all four samples lose their
    answer's later digits the same way on both sides: the model's, not the engine's)."""
    from kvjax import tasks

    model, hf = bundled
    hf.set_attn_implementation("eager")
    b = 64
    for s in tasks.generate("niah_single", context_length=1024, n=4, seed=0):
        ids = model.encode(s.prompt)
        press = kvpress.SnapKVPress(compression_ratio=1 - b / len(ids), window_size=32,
                                    kernel_size=7)
        assert kvpress.utils.compute_n_kept(len(ids), 1 - b / len(ids)) == b
        theirs = _press_greedy(hf, press, ids, s.max_new_tokens,
                               set(model.cfg.eos_token_ids))
        method = methods.SnapKV(budget=b, window=32, kernel=7, pooling="avg", gqa="mean")
        ours = engine.run(model.params, model.cfg, [ids], method,
                          max_new_tokens=s.max_new_tokens).tokens[0]
        print(f"{model.decode(ours)!r} vs {model.decode(theirs)!r} (answer {s.answer})")
        assert ours == theirs
