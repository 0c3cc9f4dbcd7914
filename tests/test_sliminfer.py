"""SlimInfer and LazyLLM: a reference over HF layers of the same weights, invariants, host
offload, errors and end-to-end runs.

The reference runs the HF decoder layers themselves (eager, fp32) on the token subsets that
pruning leaves, each with its original positions (HF has no hidden-state pruning), takes q
and k at the pruning layers from the HF modules (input norm, projections, HF RoPE), and in
plain numpy recomputes Eq. 1-2 block scores and the kept blocks at every pruning layer.
For decoding it replays SlimInfer's decode semantics in torch on dictionaries of per-block
KV (the new token attends to the active blocks and the generated tokens; a block entering
a stage without KV there is recomputed from its stored hidden state), with the same
tokens as kvjax, and checks the active sets that Algorithm 1 gives at every step.

Tolerance: kept sets must be equal; scores agree to 1e-4 of the largest score magnitude
(seen: <= 2e-5; HF and kvjax both fp32, drift accumulates over 12 random-weight layers).
Decode steps are compared until a candidate set is decided by a near-tie (a gap within the
same tolerance), after which the two runs may legitimately follow different sets.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import monitoring

from kvjax import engine, methods
from kvjax.methods.slim import blocks as core
from kvjax.methods.slim import host_store as offload

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

torch.set_num_threads(1)  # a shared 2-core machine: OpenMP waits under contention

L = 12
BS, UNIT, W = 16, 4, 4
LAYERS, KEEP = (3, 6, 9), (128, 96, 64)  # 8, 6, 4 blocks of 16
NEW = 8
# lengths in one padded bucket (320): one compilation for every test that uses them;
# 305 = 19 * 16 + 1: the last 4 tokens straddle two blocks
LENGTHS = (300, 305, 318)
# fp32 drift over 12 random layers: scores agree to ~2e-5 of their largest magnitude
TOL = 1e-4


@pytest.fixture(scope="module")
def pair():
    return hf_models.build_pair("llama_llama3rope_gqa4", seed=1, scale=0.3, layers=L)


def slim(**kw):
    """The tests' SlimInfer: the lagged decode timing and the forced tail blocks (the paper's
    timing and forcing have their own test, `test_reference_decode_paper_timing`)."""
    return methods.create("sliminfer", **{**dict(layers=LAYERS, keep=KEEP, block=BS, unit=UNIT,
                                                 window=W, decode_forced="sink_and_tail",
                                                 decode_timing="lagged"), **kw})


def prompt(i, n=None):
    return [int(t) for t in np.random.default_rng(i).integers(3, 97, n or LENGTHS[i % 3])]


@pytest.fixture(scope="module")
def runs(pair):
    """One batch of the three prompts (ragged, left-padded to one bucket), shared by the
    tests: one prefill and one step compilation serve every sliminfer test here."""
    _, cfg, params = pair
    return engine.run(params, cfg, [prompt(i) for i in range(3)], slim(), max_new_tokens=NEW,
                      stop_ids=())


def batch(seeds):
    return [prompt(i) for i in seeds]


# ---- the reference --------------------------------------------------------------------------


class Ref:
    """HF layers + numpy Eq. 1-2; per-layer KV kept per block, as dictionaries."""

    def __init__(self, model, cfg):
        self.m, self.cfg = model, cfg
        self.layers = model.model.layers
        self.rot = model.model.rotary_emb
        self.G = cfg.num_heads // cfg.num_kv_heads

    def qkv(self, l, h, pos):
        a = self.layers[l].self_attn
        x = self.layers[l].input_layernorm(h)
        S, Dh = h.shape[1], self.cfg.head_dim
        q = a.q_proj(x).view(1, S, -1, Dh).transpose(1, 2)
        k = a.k_proj(x).view(1, S, -1, Dh).transpose(1, 2)
        v = a.v_proj(x).view(1, S, -1, Dh).transpose(1, 2)
        cos, sin = self.rot(h, torch.tensor([pos]))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q[0], k[0], v[0]  # [H, S, Dh], [K, S, Dh]

    def hf_layer(self, l, h, pos):
        """The HF decoder layer on a token subset at its original positions."""
        p = torch.tensor(pos)
        mask = torch.where(p[None, :] <= p[:, None], 0.0, torch.finfo(torch.float32).min)
        return self.layers[l](h, attention_mask=mask[None, None],
                              position_embeddings=self.rot(h, p[None]), position_ids=p[None])

    def layer_ctx(self, l, h, pos, ctx):
        """Layer l for queries h [1, S, D] at `pos`, attending to ctx = (k, v, kpos) plus
        their own keys, causally by position (torch, fp32, as the HF eager layer)."""
        q, k, v = self.qkv(l, h, pos)
        ck, cv, cp = ctx
        keys, vals = torch.cat([ck, k], 1), torch.cat([cv, v], 1)
        kp = torch.tensor(list(cp) + list(pos))
        s = torch.einsum("hsd,htd->hst", q, keys.repeat_interleave(self.G, 0)) * q.shape[-1] ** -0.5
        s = s.masked_fill(kp[None, None, :] > torch.tensor(pos)[None, :, None], -torch.inf)
        o = torch.einsum("hst,htd->shd", s.softmax(-1), vals.repeat_interleave(self.G, 0))
        lay = self.layers[l]
        h = h + lay.self_attn.o_proj(o.reshape(1, len(pos), -1))
        return h + lay.mlp(lay.post_attention_layernorm(h)), q, k, v


def eq2(q_WHD, keys_by_block, n, G):
    """Eq. 1-2 in numpy: block id -> max_m mean_h q_l^h . mean(unit keys of head h's group)."""
    ql = q_WHD.mean(0)  # [H, Dh]
    out = {}
    for b, k_KSD in keys_by_block.items():
        units = [k_KSD[:, u: u + UNIT].mean(1) for u in range(0, k_KSD.shape[1], UNIT)]
        out[b] = max(float(np.mean([ql[h] @ rep[h // G] for h in range(ql.shape[0])]))
                     for rep in units)
    return out


def choose(scores, count, forced):
    """Forced blocks plus the top-scoring others (ties: lower id), `count` in all."""
    rest = sorted((b for b in scores if b not in forced), key=lambda b: (-scores[b], b))
    return sorted(set(forced) | set(rest[: count - len(forced)]))


def near_tie(scores, chosen, forced):
    rest = [scores[b] for b in scores if b not in forced]
    inside = [scores[b] for b in chosen if b not in forced]
    outside = [s for s in rest if s not in inside]
    if not inside or not outside:
        return False
    lo, hi = min(inside), max(outside)
    return abs(lo - hi) <= TOL * max(abs(v) for v in scores.values())


def blocks_of(n):
    return {b: list(range(b * BS, min((b + 1) * BS, n))) for b in range(-(-n // BS))}


_PREFILLS: dict = {}


def ref_prefill(ref, ids):
    """Cached: the decode reference starts from the prefill reference of the same prompt
    (its KV dictionaries are copied, since decoding adds to them)."""
    key = tuple(ids)
    if key not in _PREFILLS:
        _PREFILLS[key] = _ref_prefill(ref, ids)
    out, kv, aux, rings = _PREFILLS[key]
    return (out, {l: dict(d) for l, d in kv.items()}, [dict(a) for a in aux],
            [list(r) for r in rings])


def _ref_prefill(ref, ids):
    """Reference prefill: per pruning layer the scores and kept blocks; per layer the KV of
    every block it saw; per slim stage the hidden states at its input; the q rings."""
    n = len(ids)
    span = blocks_of(n)
    forced = core.forced_block_ids(n, BS, W, 1)
    with torch.no_grad():
        h = ref.m.model.embed_tokens(torch.tensor([ids]))
        present, kv, aux, rings, out = sorted(span), {}, [], [], []
        for l in range(L):
            pos = [p for b in present for p in span[b]]
            q, k, v = ref.qkv(l, h, pos)
            at = {b: [pos.index(p) for p in span[b]] for b in present}
            kv[l] = {b: (k[:, at[b]], v[:, at[b]]) for b in present}
            h = ref.hf_layer(l, h, pos)
            if l in LAYERS:
                i = LAYERS.index(l)
                qt = q[:, -W:].transpose(0, 1).numpy()  # [w, H, Dh]: the last w prompt tokens
                sc = eq2(qt, {b: kv[l][b][0].numpy() for b in present}, n, ref.G)
                kept = choose(sc, KEEP[i] // BS, forced)
                out.append((sc, kept))
                rings.append(list(q[:, -W:].transpose(0, 1)))
                aux.append({b: h[:, [pos.index(p) for p in span[b]]] for b in present})
                h = h[:, [pos.index(p) for b in kept for p in span[b]]]
                present = kept
    return out, kv, aux, rings


def ref_decode(ref, ids, tokens, gamma, restrict=False, timing="lagged", tail=True):
    """SlimInfer decode replayed with the given tokens: the active sets used at each step
    (per slim stage) and whether each decision was a near-tie. `timing` "lagged": the
    candidates computed after step t decide step t+1; "paper": stage i's candidates are
    scored right after pruning layer p_i with the current token's query, and decide that
    token's stage-i blocks. `tail`: the last w prompt tokens' blocks are forced too."""
    n = len(ids)
    span = blocks_of(n)
    forced = core.forced_block_ids(n, BS, W, 1) if tail else {0}
    stages = [(0, LAYERS[0] + 1)] + [(a + 1, b + 1) for a, b in zip(LAYERS, LAYERS[1:] + (L - 1,))]
    pre, kv, aux, rings = ref_prefill(ref, ids)
    active = [set(kept) for _, kept in pre]
    gen = {l: [] for l in range(L)}  # (k [K,1,Dh], v, pos)

    def candidate(i):
        p = LAYERS[i]
        elig = set(kv[p + 1]) if restrict else set(kv[p])
        ql = torch.stack(rings[i][-W:]).numpy()
        sc = eq2(ql, {b: kv[p][b][0].numpy() for b in elig}, n, ref.G)
        c = choose(sc, KEEP[i] // BS, forced & elig)
        return set(c), near_tie(sc, c, forced)

    def decide(i, c):
        """Algorithm 1 for stage i: the blocks revived there (no KV at its layers yet)."""
        if len(c & active[i]) / len(c) >= gamma:
            return set()
        revived = {b for b in c - active[i] if b not in kv[stages[i + 1][0]]}
        active[i] = set(c)
        return revived

    history, tie_at = [], None
    cands = [candidate(i) for i in range(len(LAYERS))]
    with torch.no_grad():
        for t, tok in enumerate(tokens):
            revive = [set() for _ in LAYERS]
            if timing == "lagged":
                for i, (c, tie) in enumerate(cands):
                    revive[i] = decide(i, c)
                    tie_at = t if tie_at is None and tie else tie_at
                history.append([sorted(a) for a in active])
            pos_t = n + t
            h = ref.m.model.embed_tokens(torch.tensor([[tok]]))
            for s, (a, b) in enumerate(stages):
                if s and timing == "paper":  # stage s's blocks, chosen at p_s for this token
                    c, tie = candidate(s - 1)
                    revive[s - 1] = decide(s - 1, c)
                    tie_at = t if tie_at is None and tie else tie_at
                blocks = sorted(span) if s == 0 else sorted(active[s - 1])
                hr = None
                if s and revive[s - 1]:
                    rb = sorted(revive[s - 1])
                    hr = torch.cat([aux[s - 1][x] for x in rb], 1)
                    rpos = [p for x in rb for p in span[x]]
                for l in range(a, b):
                    if hr is not None:  # revived blocks: their KV here, then their layer output
                        others = [x for x in blocks if x not in revive[s - 1]]
                        ctx = (torch.cat([kv[l][x][0] for x in others], 1),
                               torch.cat([kv[l][x][1] for x in others], 1),
                               [p for x in others for p in span[x]])
                        hr, _, k, v = ref.layer_ctx(l, hr, rpos, ctx)
                        for x in rb:
                            sl = [rpos.index(p) for p in span[x]]
                            kv[l][x] = (k[:, sl], v[:, sl])
                    ks = [kv[l][x][0] for x in blocks] + [g[0] for g in gen[l]]
                    vs = [kv[l][x][1] for x in blocks] + [g[1] for g in gen[l]]
                    ps = [p for x in blocks for p in span[x]] + [g[2] for g in gen[l]]
                    ctx = (torch.cat(ks, 1), torch.cat(vs, 1), ps)
                    h, q, k, v = ref.layer_ctx(l, h, [pos_t], ctx)
                    gen[l].append((k, v, pos_t))
                    if l in LAYERS:
                        rings[LAYERS.index(l)].append(q[:, 0])
                if hr is not None and s < len(LAYERS):
                    for x in rb:
                        aux[s][x] = hr[:, [rpos.index(p) for p in span[x]]]
            if timing == "paper":
                history.append([sorted(a) for a in active])
            else:
                cands = [candidate(i) for i in range(len(LAYERS))]
    return history, tie_at


# ---- tests ----------------------------------------------------------------------------------


def test_reference_prefill_scores_and_kept_blocks(pair, runs):
    model, cfg, _ = pair
    ref = Ref(model, cfg)
    g = runs
    for i in range(3):
        expect, *_ = ref_prefill(ref, prompt(i))
        for j, (sc, kept) in enumerate(expect):
            got = [b for b in g.stats["kept_blocks"][i][j] if b >= 0]
            assert got == kept, (i, j, got, kept)
            scores = np.array(g.stats["block_scores"][i][j])
            want = np.array(list(sc.values()))
            np.testing.assert_allclose(scores[list(sc)], want, atol=TOL * np.abs(want).max())
            assert np.all(np.isinf(np.delete(scores, list(sc))))  # absent blocks: -inf


def test_reference_decode_active_sets(pair, runs):
    """Decode-time re-selection with the overlap test (gamma 0.9), revival included."""
    model, cfg, _ = pair
    ref = Ref(model, cfg)
    compared, g = 0, runs
    for i in range(3):
        hist, tie_at = ref_decode(ref, prompt(i), g.tokens[i], gamma=0.9)
        got = [[sorted(int(b) for b in a[i] if b >= 0) for a in step] for step in g.state.history]
        upto = len(hist) if tie_at is None else tie_at + 1
        assert got[:upto] == hist[:upto], (i, upto)
        compared += upto
    swaps = sum(sum(s) for s in g.stats["swaps"])
    assert compared >= 2 * NEW and swaps > 0 and sum(g.stats["blocks_revived"]) > 0, (
        compared, swaps)


def test_reference_decode_paper_timing(pair):
    """The defaults (the paper's): the blocks of stage i are chosen right after pruning
    layer p_i with the current token's query window, and only block 0 is forced; against
    the reference replaying the same timing, revival included."""
    model, cfg, params = pair
    ref = Ref(model, cfg)
    m = methods.create("sliminfer", layers=LAYERS, keep=KEEP, block=BS, unit=UNIT, window=W)
    assert (m.decode_timing, m.decode_forced) == ("paper", "sink")
    g = engine.run(params, cfg, [prompt(i) for i in range(3)], m, max_new_tokens=NEW,
                   stop_ids=())
    compared = 0
    for i in range(3):
        hist, tie_at = ref_decode(ref, prompt(i), g.tokens[i], gamma=0.9, timing="paper",
                                  tail=False)
        got = [[sorted(int(b) for b in a[i] if b >= 0) for a in step] for step in g.state.history]
        upto = len(hist) if tie_at is None else tie_at
        assert got[:upto] == hist[:upto], (i, upto)
        compared += upto
    assert compared >= 2 * NEW and sum(sum(s) for s in g.stats["swaps"]) > 0, compared


def test_invariants(pair, runs):
    _, cfg, _ = pair
    g = runs
    for i in range(3):
        n = len(prompt(i))
        forced = core.forced_block_ids(n, BS, W, 1)
        # stage sizes: every prompt token, then exactly the schedule's tokens per stage
        want = [n] + [sum(len(blocks_of(n)[b]) for b in kb if b >= 0)
                      for kb in g.stats["kept_blocks"][i]]
        assert g.stats["stage_tokens"][i] == want
        kept = [sum(1 for b in kb if b >= 0) for kb in g.stats["kept_blocks"][i]]
        assert kept == [k // BS for k in KEEP]
        assert g.stats["layer_tokens"][i] == [n] * 4 + [want[1]] * 3 + [want[2]] * 3 + [want[3]] * 2
        for step in g.state.history:  # block 0 and the last w tokens' blocks always active
            for a in step:
                blocks = [int(b) for b in a[i] if b >= 0]
                assert forced <= set(blocks) and len(set(blocks)) == len(blocks)
        c = g.cache  # generated tokens: live at every layer, at positions n..n+NEW-1
        for layer in range(L):
            live = np.asarray(c.pos[layer, i, 0])[np.asarray(c.valid[layer, i, 0])]
            assert set(range(n, n + NEW)) <= set(live.tolist())
            assert 0 in live and n - 1 in live
        assert g.stats["device_kv_bytes"][i] < g.stats["device_kv_bytes_full"][i]


def executables():
    return set(engine.executables._EXECUTABLES)


def new_programs(before) -> list[str]:
    """The programs compiled since `before` (`executables()`), by name, except the decode
    steps that differ from one compiled before only in how many revived rows they compute
    (`swap.revived_rows`: a few bucketed sizes, each compiled once)."""
    def shapes(key):
        return key[:3], [s for s, _, _ in key[3]]

    out = []
    for k in executables() - before:
        (fn, static, tree), sh = shapes(k)
        rows_only = fn is engine.steps.decode_segment and any(
            (fn, static, tree) == o[:3] and len(sh) == len(so) and sum(
                a != b for a, b in zip(sh, so)) == 1 and all(
                a[:-1] == b[:-1] for a, b in zip(sh, so) if a != b)
            for o in before for so in [shapes(o)[1]])
        if not rows_only:
            out.append(fn.__name__)
    return out


def test_gamma_extremes_and_restrict(pair, runs):
    _, cfg, params = pair
    ids = batch((3, 4, 5))
    before = executables()
    g1 = engine.run(params, cfg, ids, slim(gamma=1.0), max_new_tokens=NEW, stop_ids=())
    g0 = engine.run(params, cfg, ids, slim(gamma=0.0), max_new_tokens=NEW, stop_ids=())
    gr = engine.run(params, cfg, ids, slim(decode="restrict"), max_new_tokens=NEW, stop_ids=())
    assert new_programs(before) == [], "gamma / decode variants reuse the compiled prefill and step"
    # gamma = 1: the active set is the previous step's candidate set, changing only when they do
    hist = g1.state.history
    cands = g1.state.cand_history
    changed = 0
    for t in range(1, len(hist)):
        for i in range(len(LAYERS)):
            for e in range(3):
                a, prev = set(hist[t][i][e]) - {-1}, set(hist[t - 1][i][e]) - {-1}
                cand = set(int(b) for b in cands[t - 1][i][e])
                assert a == cand and (a != prev) == (cand != prev)
                changed += a != prev
    assert changed > 0
    # gamma = 0 and restrict: never a swap, the prefill's sets throughout
    for g in (g0, gr):
        assert sum(map(sum, g.stats["swaps"])) == 0 and g.stats["bytes_h2d"] == [0] * 3
        first = [a.tolist() for a in g.state.history[0]]
        assert all([a.tolist() for a in h] == first for h in g.state.history)
    assert gr.stats["blocks_revived"] == [0] * 3


def test_one_compilation_across_steps_and_prompts(pair, runs):
    """Another prompt of the bucket: no new prefill or step executable; a repeat of it
    compiles nothing at all (every per-block transfer function is compiled once too)."""
    _, cfg, params = pair
    before = executables()
    g = engine.run(params, cfg, batch((6, 7, 8)), slim(), max_new_tokens=NEW, stop_ids=())
    assert new_programs(before) == [] and g.stats["decode_steps"] == [NEW] * 3
    _COMPILES.clear()
    again = engine.run(params, cfg, batch((6, 7, 8)), slim(), max_new_tokens=NEW, stop_ids=())
    assert _COMPILES == [] and again.tokens == g.tokens


_COMPILES: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: _COMPILES.append(e)
    if e == "/jax/core/compile/backend_compile_duration" else None)


def test_host_round_trip_bit_identical():
    store = offload.HostStore()
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 16, 8))
    y = jax.random.randint(jax.random.PRNGKey(1), (16,), 0, 1 << 30)
    moved = store.put("blk", (x, y))
    assert moved == x.size * 4 + y.size * 4 == store.bytes_to_host
    back = store.get("blk")
    assert np.asarray(back[0]).tobytes() == np.asarray(x).tobytes()
    assert np.asarray(back[1]).tobytes() == np.asarray(y).tobytes()
    kinds = offload.memory_kinds()
    if "pinned_host" in kinds:
        assert store.items["blk"][0].sharding.memory_kind == "pinned_host"
        assert back[0].sharding.memory_kind == "device"
    d = offload.overlap_test({0, 1, 2, 3}, {0, 1, 2, 4}, 0.9, in_memory={3})
    assert d.swapped and d.load == [4] and d.leave == [3] and d.offload == []
    assert not offload.overlap_test({0, 1, 2, 3}, {0, 1, 2, 4}, 0.75, set()).swapped


def test_context_only(pair, runs):
    """Context-only: the context is pruned alone, the question prefilled on top (never
    pruned, like generated tokens); decoding re-selects from the question's queries. Same
    bucket and cache capacity as `runs`: the prefill and step are reused."""
    _, cfg, params = pair
    ctx = [prompt(i)[:-6] for i in range(3)]
    questions = [prompt(i)[-6:] for i in range(3)]
    before = executables()
    co = engine.run(params, cfg, ctx, slim(), questions=questions, max_new_tokens=NEW - 6,
                    stop_ids=())
    assert new_programs(before) == ["extend"]  # the question chunk's extend only
    assert [len(t) for t in co.tokens] == [NEW - 6] * 3
    assert co.stats["decode_steps"] == [NEW - 6] * 3
    for i, c in enumerate(ctx):
        n = len(c)
        for layer in (0, L - 1):
            live = np.asarray(co.cache.pos[layer, i, 0])[np.asarray(co.cache.valid[layer, i, 0])]
            assert set(range(n, n + NEW)) <= set(live.tolist())  # question + answer kept


def test_lazyllm_reference_and_end_to_end(pair):
    """LazyLLM: per pruning layer, keep ceil(50%) of the present tokens by the last token's
    head-mean softmax attention (plus the last token)."""
    model, cfg, params = pair
    ref = Ref(model, cfg)
    ids = prompt(0)
    g = engine.run(params, cfg, [ids], methods.create("lazyllm", layers=LAYERS),
                   max_new_tokens=4, stop_ids=())
    with torch.no_grad():
        h = model.model.embed_tokens(torch.tensor([ids]))
        present = list(range(len(ids)))
        for l in range(L):
            q, k, _ = ref.qkv(l, h, present)
            h = ref.hf_layer(l, h, present)
            if l in LAYERS:
                s = torch.einsum("hd,hsd->hs", q[:, -1], k.repeat_interleave(ref.G, 0))
                att = (s * q.shape[-1] ** -0.5).softmax(-1).mean(0).numpy()
                keep = -(-len(present) // 2)
                order = sorted(range(len(present) - 1), key=lambda j: (-att[j], j))
                sel = sorted(order[: keep - 1] + [len(present) - 1])
                got = [b for b in g.stats["kept_blocks"][0][LAYERS.index(l)] if b >= 0]
                assert got == [present[j] for j in sel]
                h, present = h[:, sel], [present[j] for j in sel]
    assert len(g.tokens[0]) == 4 and g.stats["stage_tokens"][0] == [300, 150, 75, 38]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 320), count=st.integers(3, 8),
       gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_selection_and_overlap_properties(seed, n, count, gamma):
    """choose(): forced blocks always in, `count` (or every live block) kept, ascending,
    unique; Algorithm 1: gamma 0 never swaps, gamma 1 swaps exactly when the candidates
    differ, a swap makes the candidates active and offloads only what memory lacks."""
    rng = np.random.default_rng(seed)
    NB = 20
    ids = np.arange(NB)[None]
    live = ids * BS < n
    s = rng.normal(size=(1, NB)).astype(np.float32)
    forced = np.asarray(core.forced_mask(ids, np.array([n]), BS, W, 1))
    idx, ok = (np.asarray(a)[0] for a in core.choose(s, forced, live, np.array([count]), 8))
    kept = idx[ok]
    assert list(kept) == sorted(set(kept.tolist()))
    assert set(np.flatnonzero(forced[0] & live[0])) <= set(kept.tolist())
    assert len(kept) == min(max(count, int((forced & live).sum())), int(live.sum()))
    rest = [b for b in range(NB) if live[0, b] and not forced[0, b]]
    top = sorted(rest, key=lambda b: (-s[0, b], b))[: len(kept) - int((forced & live).sum())]
    assert set(top) <= set(kept.tolist())
    active = set(rng.choice(NB, 6, replace=False).tolist())
    cand = set(rng.choice(NB, 6, replace=False).tolist())
    memory = set(rng.choice(NB, 4, replace=False).tolist())
    d = offload.overlap_test(active, cand, gamma, memory)
    if gamma == 0.0:
        assert not d.swapped
    if gamma == 1.0:
        assert d.swapped == (cand != active)
    if d.swapped:
        assert set(d.active) == cand and set(d.load) == cand - active
        assert set(d.offload) == (active - cand) - memory
    else:
        assert set(d.active) == active and not d.load


def test_bad_input(pair):
    _, cfg, params = pair
    ids = prompt(1)  # 305 tokens: the last 4 straddle blocks 18 and 19
    for kw, msg in [(dict(keep=(100, 64, 32)), "block=16 does not divide keep"),
                    (dict(keep=(640, 64, 48)), "keep\\[0\\]=640 exceeds the prompt length 305"),
                    (dict(keep=(128, 96, 32)), "keep\\[2\\]=32 holds 2 blocks but 3"),
                    (dict(keep=(64, 96, 64)), "must not increase"),
                    (dict(keep=None, keep_of_32k=(1024, 2048, 512)), "must not increase"),
                    (dict(unit=5), "unit=5 must divide block=16"),
                    (dict(window=32), "window=32"),
                    (dict(gamma=1.5), "gamma=1.5"),
                    (dict(layers=(3, 3, 9)), "strictly increasing"),
                    (dict(layers=(3, 6)), "2 pruning layers"),
                    (dict(decode="lazy"), "decode='lazy'"),
                    (dict(decode="recompute", offload=False), "offload=True")]:
        with pytest.raises(ValueError, match=msg):
            engine.run(params, cfg, [ids], slim(**kw), max_new_tokens=1)


def test_paper_schedule_scaling():
    cfg = dataclasses.replace(hf_cfg_12(), num_layers=12)
    m = methods.create("sliminfer")
    plan = m.plan(cfg, 2048)
    assert m.schedule_layers(cfg) == (4, 8, 11) and plan.layers == (4, 8)  # 11 = L-1: no stage
    assert plan.blocks == (8, 4)  # 512 and 256 tokens of 2048
    assert m.plan(cfg, 4096).blocks == (16, 8)
    assert m.plan(dataclasses.replace(cfg, num_layers=32), 32768).layers == (10, 20, 30)
    assert m.plan(dataclasses.replace(cfg, num_layers=32), 32768).blocks == (128, 64, 32)
    # `--budget B`: the last stage that exists keeps B tokens, the earlier ones 2B, 4B, ...
    b = methods.create("sliminfer").with_budget(128)
    assert b.plan(cfg, 2048).blocks == (4, 2)  # 12 layers: 256 then 128 tokens
    assert b.plan(dataclasses.replace(cfg, num_layers=32), 32768).blocks == (8, 4, 2)
    assert methods.create("sliminfer").with_budget(512).plan(cfg, 2048).blocks == (16, 8)
    # a floor of 3 blocks on the smallest stage keeps the 2:1 ratio to the stage before it
    assert m.plan(cfg, 640).blocks == (6, 3)
    with pytest.raises(ValueError, match="budget=64 is the last stage's kept tokens"):
        b.with_budget(64).validate(2000, cfg)
    b.with_budget(192).validate(2000, cfg)  # the forced blocks: the sink and the tail's one
    # the paper's (8, 4, 2) blocks at 2048 on 32 layers: kvjax's floor of 3 blocks makes it
    # (12, 6, 3); min_blocks=2 runs the paper's where the tail's 4 tokens lie in one block
    c32 = dataclasses.replace(cfg, num_layers=32)
    assert m.plan(c32, 2048).blocks == (12, 6, 3)
    paper = methods.create("sliminfer", min_blocks=2)
    assert paper.plan(c32, 2048).blocks == (8, 4, 2)
    paper.validate(2048, c32)  # forced: the sink and block 31
    with pytest.raises(ValueError, match=r"min_blocks=2: the scaled schedule keeps \[8, 4, 2\] "
                       r"blocks of a 2050-token prompt, but 3 are always active"):
        paper.validate(2050, c32)  # the last 4 tokens straddle blocks 31 and 32
    with pytest.raises(ValueError, match="min_blocks=0; allowed: >= 1"):
        methods.create("sliminfer", min_blocks=0).validate(2048, c32)


def hf_cfg_12():
    from kvjax.config import ModelConfig

    return ModelConfig(family="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                       num_layers=12, num_heads=8, num_kv_heads=2, head_dim=16,
                       max_position_embeddings=512)


@pytest.mark.slow
def test_keep_everything_equals_full_and_restrict_paths_agree(pair):
    """Budgets that keep every block give the full cache's tokens (host loop included), and
    restrict decoding gives the same tokens in the host loop and in the engine's loop."""
    _, cfg, params = pair
    ids = [prompt(i, 288) for i in (0, 1)]  # 18 whole blocks
    full = engine.run(params, cfg, ids, max_new_tokens=NEW, stop_ids=())
    everything = engine.run(params, cfg, ids, slim(keep=(288, 288, 288)), max_new_tokens=NEW,
                            stop_ids=())
    assert everything.tokens == full.tokens and sum(map(sum, everything.stats["swaps"])) == 0
    host = engine.run(params, cfg, ids, slim(decode="restrict"), max_new_tokens=NEW, stop_ids=())
    eng = engine.run(params, cfg, ids, methods.create(
        "sliminfer_restrict", layers=LAYERS, keep=KEEP, block=BS, unit=UNIT, window=W),
        max_new_tokens=NEW, stop_ids=())
    assert host.tokens == eng.tokens


def test_a_step_without_revived_rows_compiles_no_revival():
    """`swap.revived_rows`: the revived rows first, padded with -1 to a bucket of `block`
    * 2^k; none revived anywhere gives Rc = 0, and `revival` then returns None, so that
    step's program has no revival cond or row scatters (same tokens: those did nothing)."""
    from kvjax.methods.slim import swap

    rev = np.zeros((2, 3, 8), bool)
    idx = swap.revived_rows(rev, block=2)
    assert idx.shape == (2, 3, 0)
    state = {"xr": np.zeros((2, 3, 8, 4)), "ridx": idx, "players": np.array([1, 3]),
             "rev": rev}
    assert swap.revival(2, state, split=True) is None
    rev[1, 2, [1, 4, 5]] = True  # three rows of one element: a bucket of 4 (2 * 2)
    idx = swap.revived_rows(rev, block=2)
    assert idx.shape == (2, 3, 4) and idx[1, 2].tolist() == [1, 4, 5, -1]
    assert (idx[0] == -1).all() and (idx[1, :2] == -1).all()
    state["ridx"] = idx
    assert not bool(swap.revival(2, state, split=True).active)  # stage 0 (after layer 1): none
    r = swap.revival(4, state, split=True)  # stage 1 (after layer 3): element 2's rows
    assert bool(r.active) and r.slot[2].tolist() == [1, 4, 5, -1]
