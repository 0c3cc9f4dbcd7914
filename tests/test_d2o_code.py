"""`d2o_code` against a numpy port of the authors' code, step by step.

What the reference follows (AIoT-MLSys-Lab/d2o, `LLM_merge_new/LMEval_kv_token_merge/
modeling_llama3_7b_13b_d2o.py`, "the code"; the layer ratios in `modeling_llama3_new.py`):

- prompt (lines 626-643): per query head the column sums of the prompt attention
  (`prefill_score`) and their unbiased variance (`attn_sum.var(dim=-1)`), min-max normalised
  across the heads (`+ 1e-6`), mean over heads = F_v of the layer; nothing is evicted;
- layer ratios at the first decoding step (`modeling_llama3_new.py:706-723`): r_l =
  clamp(softmax(-F_v) * L * rho, 0.01, 1), heavy r_l * hh_ratio / rho, recent r_l *
  recent_ratio / rho (rho = hh_ratio + recent_ratio; here rho = budget / n, half each);
- first decoding step (lines 646-657, then `D2O_LayerKVCache.__call__`, 316-406): scores =
  prompt column sums + the step's attention; hh_size = int(S * heavy), recent_size = int(S *
  recent) with S = n + 1 (lines 323-327); the first 4 scores set to +inf *in place* (line
  346: they stay +inf); keep the top hh_size of the non-recent part and the recent_size
  newest; cosine of each pruned key with the kept keys of its head; threshold = mean of the
  max similarities (line 371); the p-th pruned entry of every head merges when the mean
  over heads of their max similarities >= threshold (line 376), by `scatter_reduce(mean,
  include_self)` of max-similarity-weighted keys and values (lines 401-404);
- later steps (lines 660-667): the step's attention added to the kept scores (`_update_hh_
  score`), one entry evicted, threshold = 0.5 * threshold + 0.5 * mean over heads (line 375,
  alpha = belta = 0.5, the script's defaults);
- layers 0, 1 and L-1 are never compressed (line 653), at this model's depth (6 layers).

The reference is per query head; the model is MHA (llama_mha_tied), where query heads and
KV heads coincide, so kvjax's per-KV-head cache is the code's cache exactly. The
configuration is checked to stay on the code's regular path: every compressed layer keeps
<= n - 2 entries after the first step (a layer kept at n or n - 1 re-enters the code's
first-step branch with misaligned prompt scores; module docstring of
`kvjax/methods/d2o/discriminative.py`). The attention of every new token comes from HF's
eager layers over the reference's own cache (`hf_decode.step`).

Compared after the prompt and after every step: the layer ratios, S_l and M_l, each head's
kept positions (the kept set), keys and values (the merged rows), the accumulated scores
of the non-sink entries, each layer's threshold, and the merge / discard counts.
Tolerances: keys/values rtol 2e-5, atol 5e-5 (HF and kvjax projections differ by fp32
rounding; see tests/test_d2o.py); scores and thresholds 1e-5 (sums of probabilities and
cosines of such keys); ratios rtol 1e-5. A wrong eviction or merge moves an entry by 1e-2
or more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import engine, methods
from kvjax.compression.layer import LayerIO

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")
hf_decode = pytest.importorskip("hf_decode")

L = 6
N = 48
STEPS = 6
BUDGET = 16  # rho = 1/3


@pytest.fixture(scope="module")
def pair():
    return hf_models.build_pair("llama_mha_tied", seed=2, scale=0.2, layers=L)


def _cos(a, b):
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return a @ np.swapaxes(b, -1, -2)


class AuthorsD2O:
    """The code's per-layer `LlamaAttention3_D2O` + `D2O_LayerKVCache` state, in numpy (MHA,
    batch 1): cache k/v [H, S, D] in position order, their positions, hh_score,
    threshold."""

    def __init__(self, attn, ks, vs, rho: float, alpha=0.5, belta=0.5, hh_split=0.5):
        self.n = attn.shape[-1]
        self.L = attn.shape[0]
        self.alpha, self.belta = alpha, belta
        self.prefill_score = attn.sum(2)  # [L, H, n]: .sum(0).sum(1), queries summed
        var = attn.sum(2).var(-1, ddof=1)  # attn_sum.var(dim=-1): unbiased, [L, H]
        norm = (var - var.min(1, keepdims=True)) / (
            var.max(1, keepdims=True) - var.min(1, keepdims=True) + 1e-6)
        self.F = norm.mean(1)
        w = np.exp(-self.F - (-self.F).max())
        w = w / w.sum()
        self.ratio = np.clip(w * self.L * rho, 0.01, 1.0).astype(np.float32)
        self.hh = self.ratio * np.float32(hh_split)  # layer_hh_ratio
        self.rec = self.ratio * np.float32(1 - hh_split)  # layer_recent_ratio
        self.k, self.v = list(ks), list(vs)
        self.pos = [np.broadcast_to(np.arange(self.n), ks.shape[1:3]).copy()
                    for _ in range(self.L)]
        self.hh_score = [None] * self.L
        self.threshold = [None] * self.L
        self.hh_size = [None] * self.L
        self.recent_size = [None] * self.L
        self.counts = np.zeros((2, self.L), int)  # merges, discards (entries, all heads)
        self.edge = {0, 1, self.L - 1}

    def step(self, hf, position: int):
        """One decoding token: hf = hf_decode.step's per-layer (attention [H, S+1], k, v)."""
        for l, (w, kn, vn) in enumerate(hf):
            self.k[l] = np.concatenate([self.k[l], kn[:, None]], 1)
            self.v[l] = np.concatenate([self.v[l], vn[:, None]], 1)
            self.pos[l] = np.concatenate([self.pos[l], np.full((len(kn), 1), position)], 1)
            key_len = self.k[l].shape[1]
            if l in self.edge:  # lines 653 and 662: pass
                continue
            if key_len - self.n == 1:  # line 646: the first decoding step
                score = np.concatenate([self.prefill_score[l] + w[:, :self.n], w[:, self.n:]], 1)
                self.kv_cache(l, score, first=True)
            elif self.n - key_len > 0:  # line 660: after compression
                self.kv_cache(l, w.copy(), first=False)
            else:
                assert self.hh_size[l] is not None and (
                    self.hh_size[l] + self.recent_size[l] >= self.n + 1), \
                    f"layer {l} left the code's regular path (cache {key_len - 1} of n={self.n})"

    def kv_cache(self, l, score, first: bool):
        """`D2O_LayerKVCache.__call__` (lines 316-406)."""
        if first:  # lines 323-327
            S = score.shape[-1]
            self.hh_size[l] = int(np.float32(S) * self.hh[l])
            self.recent_size[l] = int(np.float32(S) * self.rec[l])
        hh, rec = self.hh_size[l], self.recent_size[l]
        if self.hh_score[l] is None:  # _update_hh_score (lines 408-419)
            self.hh_score[l] = score
        else:
            score[:, :-1] += self.hh_score[l]
            self.hh_score[l] = score
        k, v, pos = self.k[l], self.v[l], self.pos[l]
        H, seq_len, D = k.shape
        if seq_len <= hh + rec:
            return
        sel = self.hh_score[l][:, :seq_len - rec]  # a view: line 346 writes hh_score
        sel[:, 0:4] = np.inf
        keep_top = np.sort(np.argsort(-sel, axis=-1, kind="stable")[:, :hh], axis=-1)
        keep_recent = np.broadcast_to(np.arange(seq_len - rec, seq_len), (H, rec))
        mask = np.zeros((H, seq_len), bool)
        np.put_along_axis(mask, np.concatenate([keep_top, keep_recent], 1), True, axis=1)
        kk, vk = k[mask].reshape(H, -1, D), v[mask].reshape(H, -1, D)
        kp, vp = k[~mask].reshape(H, -1, D), v[~mask].reshape(H, -1, D)
        self.hh_score[l] = self.hh_score[l][mask].reshape(H, hh + rec)
        self.pos[l] = pos[mask].reshape(H, -1)
        sim = _cos(kp, kk)  # [H, P, kept]
        mx, at = sim.max(-1), sim.argmax(-1)
        if self.threshold[l] is None:  # lines 370-375
            self.threshold[l] = mx.mean()
        else:
            self.threshold[l] = self.alpha * self.threshold[l] + self.belta * mx.mean()
        filt = mx.mean(0) >= self.threshold[l]  # line 376: per pruned rank, over heads
        for x, xp in ((kk, kp), (vk, vp)):  # scatter_reduce(mean, include_self), 401-404
            tot, cnt = x.copy(), np.ones(x.shape[:2])
            for h in range(H):
                for p in np.flatnonzero(filt):
                    tot[h, at[h, p]] += mx[h, p] * xp[h, p]
                    cnt[h, at[h, p]] += 1
            x[...] = tot / cnt[..., None]
        self.k[l], self.v[l] = kk, vk
        self.counts[:, l] += (H * filt.sum(), H * (~filt).sum())


DIFFS: list[float] = []


def _compare(ref: AuthorsD2O, cache, st, first_done: bool):
    for l in range(L):
        for h in range(cache.k.shape[2]):
            val = np.asarray(cache.valid[l, 0, h])
            pos = np.asarray(cache.pos[l, 0, h])[val]
            o = np.argsort(pos)
            np.testing.assert_array_equal(pos[o], ref.pos[l][h], err_msg=f"layer {l} head {h}")
            for x, r in ((cache.k, ref.k), (cache.v, ref.v)):
                got = np.asarray(x[l, 0, h])[val][o]
                tol = 5e-5 + 2e-5 * np.abs(r[l][h])
                DIFFS.append(float(np.max(np.abs(got - r[l][h]) / tol)))
                np.testing.assert_allclose(got, r[l][h], rtol=2e-5, atol=5e-5)
            if first_done and l not in ref.edge:
                acc = np.asarray(st["acc"][l, 0, h])[val][o]
                sink = pos[o] < 4  # the code's +inf
                np.testing.assert_allclose(acc[~sink], ref.hh_score[l][h][~sink], rtol=1e-5,
                                           atol=1e-5)
        tau = float(st["tau"][l, 0])
        if ref.threshold[l] is None:
            assert np.isnan(tau), (l, tau)
        else:
            np.testing.assert_allclose(tau, ref.threshold[l], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(st["merges"])[:, 0], ref.counts[0])
    np.testing.assert_array_equal(np.asarray(st["discards"])[:, 0], ref.counts[1])


def test_reference_steps_follow_the_authors_code(pair):
    """Prompt, the first step's bulk eviction with merging, then one eviction per step:
    kvjax == the numpy port of the code (module docstring) after the prompt and every step."""
    model, cfg, params = pair
    m = methods.create("d2o_code", budget=BUDGET)
    assert m.whole_layers(L).tolist() == [True, True, False, False, False, True]
    seen = np.zeros(2, int)
    for seed in range(2):
        rng = np.random.default_rng(seed)
        ids = rng.integers(3, 97, N).tolist()
        attn, ks, vs = hf_decode.prefill(model, ids)
        ref = AuthorsD2O(attn, ks, vs, rho=BUDGET / N)
        _, cache, st, stats = engine.prefill(
            params, jnp.array([ids]), jnp.ones((1, N), bool), cfg=cfg, method=m,
            capacity=m.decode_capacity(m.kept_slots(N), 0, STEPS))
        np.testing.assert_allclose(np.asarray(stats["layer_ratios"])[0], ref.ratio, rtol=1e-5)
        # the floors of S * r_l are far from an integer, so fp32 rounding cannot flip them
        for r in (ref.hh, ref.rec):
            frac = (N + 1) * r - np.floor((N + 1) * r)
            assert np.all((frac > 1e-3) & (frac < 1 - 1e-3)), frac
        assert np.all(np.asarray(cache.valid).sum(-1) == N)  # nothing evicted at the prompt
        _compare(ref, cache, st, False)
        for t, tok in enumerate(rng.integers(3, 97, STEPS).tolist()):
            hf = hf_decode.step(model, tok, N + t, list(zip(ref.k, ref.v)))
            ref.step(hf, N + t)
            _, cache, st = engine.extend(params, cache, jnp.array([[tok]]),
                                         jnp.ones((1, 1), bool), st, cfg=cfg, method=m)
            comp = [l for l in range(L) if l not in ref.edge]
            assert [int(st["budget"][l, 0]) for l in comp] == [
                ref.hh_size[l] + ref.recent_size[l] for l in comp]
            assert [int(st["recent"][l, 0]) for l in comp] == [ref.recent_size[l] for l in comp]
            assert all(ref.hh_size[l] + ref.recent_size[l] <= N - 2 for l in comp)
            _compare(ref, cache, st, True)
        seen += ref.counts.sum(1)
        sizes = [ref.hh_size[l] + ref.recent_size[l] for l in comp]
        print(f"\nseed {seed}: ratios {np.round(ref.ratio, 3)}, S_l {sizes}, "
              f"merges/discards {ref.counts.tolist()}")
    assert seen[0] > 0 and seen[1] > 0, seen
    print(f"keys/values: worst difference {max(DIFFS):.2f} of the tolerance")


def test_whole_layers_scale_with_depth():
    """The code's layers 0, 1 and L-1 (line 653; the same indices on its 32- and 40-layer
    models): the first two and the last at every depth -- the bundled model's 12 layers,
    a 32-layer model, and this file's 6."""
    m = methods.create("d2o_code")
    for depth, want in ((12, [0, 1, 11]), (32, [0, 1, 31]), (40, [0, 1, 39]), (6, [0, 1, 5])):
        assert np.flatnonzero(m.whole_layers(depth)).tolist() == want
    assert not methods.create("d2o").whole_layers(32).any()


def test_variance_readings():
    """The code's F_v (each head's unbiased variance, min-max across heads, mean) against
    the earlier reading (min-max of the column sums, then the variance) on column sums of
    a peaked random layer stack: both from independent numpy, and kvjax equals the code's."""
    rng = np.random.default_rng(0)
    Ld, B, K, G, T = 8, 1, 2, 2, 64
    acc = rng.gamma(rng.uniform(0.05, 2.0, (Ld, B, K, G, 1)), size=(Ld, B, K, G, T))
    acc = (acc / acc.sum(-1, keepdims=True) * T).astype(np.float32)
    m = methods.create("d2o_code", budget=16)
    fv = np.array([np.asarray(m.layer_variance(jnp.asarray(a), jnp.ones((B, T), bool)))
                   for a in acc])  # [L, B]
    var = acc.reshape(Ld, B, K * G, T).var(-1, ddof=1)
    want = ((var - var.min(-1, keepdims=True))
            / (var.max(-1, keepdims=True) - var.min(-1, keepdims=True) + 1e-6)).mean(-1)
    np.testing.assert_allclose(fv, want, rtol=1e-5, atol=1e-6)
    raw = methods.create("d2o", variance="raw").layer_variance
    np.testing.assert_allclose(np.array([np.asarray(raw(jnp.asarray(a), jnp.ones((B, T), bool)))
                                         for a in acc]),
                               acc.reshape(Ld, B, K * G, T).var(-1).mean(-1), rtol=1e-5)


def test_bulk_step_holds_no_slot_by_slot_similarities():
    """The first step's nearest-neighbour search runs `block` sources at a time: no value of
    the traced hook (both branches of its `lax.cond`) is C x C; the hook's Rows have C rows."""
    m = methods.create("d2o_code", budget=8, block=8)
    B, K, G, C, D = 1, 2, 2, 40, 8
    z = jnp.zeros((1, B), jnp.int32)
    st_ = {"acc": jnp.zeros((1, B, K, C)), "tau": jnp.full((1, B), jnp.nan), "budget": z,
           "recent": z, "whole": jnp.zeros((1, B), bool), "ratio": jnp.full((1, B), 0.3),
           "sized_from": z, "prompt": jnp.array([C - 1]), "steps": jnp.int32(0),
           "merges": z, "discards": z}
    io = LayerIO(jnp.int32(0), jnp.zeros((B, 1, K * G, D)), jnp.ones((B, K, C, D)),
                 jnp.ones((B, K, C, D)), jnp.broadcast_to(jnp.arange(C), (B, K, C)),
                 jnp.ones((B, K, C), bool), jnp.full((B, 1), C), jnp.zeros((B, 1, K * G, D)),
                 jnp.zeros((B, 1, 4)), jnp.ones((B, 1), bool))
    closed = jax.make_jaxpr(m.decode_layer)(io, jnp.ones((B, K, G, 1, C)), st_)

    def shapes(jaxpr):
        for e in jaxpr.eqns:
            yield from (v.aval.shape for v in e.outvars if hasattr(v.aval, "shape"))
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else [p]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from shapes(inner)

    seen = list(shapes(closed.jaxpr))
    assert (8, C) in [s[-2:] for s in seen]  # the blocks are there
    assert not [s for s in seen if s[-2:] == (C, C)]
    (k, v, _, _), _ = jax.eval_shape(m.decode_layer, io, jnp.ones((B, K, G, 1, C)), st_)
    assert k.idx.shape == (B, K, C) and v.new.shape == (B, K, C, D)


@pytest.mark.slow
@pytest.mark.parametrize("depth", [12, 32])
def test_engine_run_keeps_the_edge_layers_whole(depth):
    """engine.run (the compiled decode loop) on a random model of the bundled model's depth
    (12) and of Llama-2-7B's / Llama-3-8B's (32): layers 0, 1 and L-1 keep every entry
    (prompt + generated), every other layer holds exactly its S_l after the loop; the first
    step merged and discarded; decode_stats reports the sizes."""
    _, cfg, params = hf_models.build_pair("llama_llama3rope_gqa4", seed=3, scale=0.3,
                                          layers=depth)
    ids = np.random.default_rng(5).integers(3, 97, 64).tolist()
    m = methods.create("d2o_code", budget=16)
    g = engine.run(params, cfg, [ids], m, max_new_tokens=5, stop_ids=())
    live = np.asarray(g.cache.valid).sum(-1)[:, 0]  # [L, K]
    whole = m.whole_layers(depth)
    assert np.all(live[whole] == 64 + 5)  # every generated token went through the layers
    s = np.asarray(g.state["budget"])[:, 0]
    assert np.all(live[~whole] == s[~whole, None])
    assert np.all(s[~whole] < 64)
    assert np.asarray(g.state["merges"]).sum() > 0 and np.asarray(g.state["discards"]).sum() > 0
    assert g.stats["layer_whole"][0] == whole.tolist()
    assert [x for x, w in zip(g.stats["layer_sizes"][0], whole) if not w] == s[~whole].tolist()


@pytest.mark.parametrize("question", [False, True])
def test_peeled_first_step_equals_the_one_program(pair, question, monkeypatch):
    """The engine runs the code's first extension (the question chunk, else the first
    decoding step) as its own program and the later steps without the bulk step's C-row
    write (`extension_phases`): the same tokens and statistics as the single program that
    chooses the bulk step under `lax.cond`."""
    _, cfg, params = pair
    m = methods.create("d2o_code", budget=BUDGET)
    first, later = m.extension_phases()
    assert (first.phase, later.phase) == ("first", "later") and first != later != m
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 97, N).tolist(), rng.integers(3, 97, N - 7).tolist()]
    qs = [rng.integers(3, 97, 5).tolist(), rng.integers(3, 97, 3).tolist()] if question else None
    kw = dict(questions=qs, max_new_tokens=STEPS, stop_ids=())
    peeled = engine.run(params, cfg, prompts, m, **kw)
    monkeypatch.setattr(type(m), "extension_phases", lambda self: None)
    one = engine.run(params, cfg, prompts, m, **kw)
    np.testing.assert_array_equal(np.asarray(peeled.tokens), np.asarray(one.tokens))
    for key in ("layer_sizes", "layer_whole", "budget_gap", "layer_budgets"):
        np.testing.assert_array_equal(np.asarray(peeled.stats[key]),
                                      np.asarray(one.stats[key]), err_msg=key)
    assert peeled.stats["kv_bytes_live"] == one.stats["kv_bytes_live"]
    assert peeled.stats["kv_bytes_live_end"] == one.stats["kv_bytes_live_end"]
    if not question:  # nothing evicted at prefill; the first decoding step evicts (0.75 here)
        live, end = peeled.stats["kv_bytes_live"], peeled.stats["kv_bytes_live_end"]
        assert live == peeled.stats["kv_bytes_full"] and end < 0.85 * live
