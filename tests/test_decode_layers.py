"""Decode's layer loop (`Kernels.decode_layers`): the loop over per-layer buffers gives the
scan's tokens and cache, for every registered method, question-aware and context-only; and
an append is one in-place `dynamic_update_slice` equal to the scatter it replaces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.compression import cache as kvcache
from kvjax.pallas.dispatch import Kernels

# in the fast suite: the plain step (full, SnapKV; full also context-only), an evicting hook
# (H2O) and one with two extension phases and merging rows (d2o_code); every other case,
# with -m slow
FAST = {("full", False), ("full", True), ("snapkv", False), ("h2o", False),
        ("d2o_code", False)}


def _cases():
    for name in methods.names():
        for context_only in (False, True):
            yield pytest.param(
                name, context_only, id=f"{name}-{'context_only' if context_only else 'qa'}",
                marks=() if (name, context_only) in FAST else pytest.mark.slow)


@pytest.fixture(scope="module")
def setup():
    model = kvjax.load("tiny-retrieval")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, model.cfg.vocab_size, n).tolist() for n in (300, 260)]
    questions = [rng.integers(5, model.cfg.vocab_size, n).tolist() for n in (12, 7)]
    return model, prompts, questions


def _method(name):
    m = methods.create(name)
    return m.with_budget(160) if m.takes_budget() else m  # SlimInfer takes >= 128 here


@pytest.mark.parametrize("name, context_only", _cases())
def test_per_layer_decode_equals_the_scan(setup, name, context_only):
    model, prompts, questions = setup
    m = _method(name)
    runs = {lay: engine.run(model.params, model.cfg, prompts, m, max_new_tokens=6,
                            questions=questions if context_only else None,
                            kernels=Kernels(decode_layers=lay))
            for lay in ("scan", "per_layer")}
    scan, per = runs["scan"], runs["per_layer"]
    # a step whose hooks read one layer at a time goes to per-layer buffers (a method with
    # decode hooks too); one that recomputes rows or runs between layers keeps the scan
    want = "per_layer" if m.layered_hooks() else "scan"
    assert per.stats["kernels"]["decode_layers"] == want
    assert scan.stats["kernels"]["decode_layers"] == "scan"
    assert per.tokens == scan.tokens
    _same_cache(per.cache, scan.cache, m)


def _same_cache(got, want, m):
    """The plain step: the same program math on the same buffers, equal bit for bit
    (measured), so no tolerance; a layout that changed a sum's order would show here first.
    A step with decode hooks: XLA fuses the hidden state's arithmetic (and D2O's and CaM's
    merged rows) differently across the unrolled layers than in the scan, so the generated
    tokens' keys and values differ by float32 rounding (measured up to 3e-6 on entries of
    order 1): 1e-5 there; positions and masks exact."""
    for f in ("k", "v", "pos", "valid", "end", "next_pos"):
        a, b = np.asarray(getattr(got, f)), np.asarray(getattr(want, f))
        if f in ("k", "v") and not m.plain_decode():
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f)
        else:
            np.testing.assert_array_equal(a, b, err_msg=f)


# per-layer storage: the plain step and one method of each other prefill kind (a decode
# hook, token selection, block pruning, a replay after the prefill) in the fast suite
FAST_STORED = {"full", "snapkv", "h2o", "asl", "sliminfer", "critical_snapkv"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n in FAST_STORED else pytest.mark.slow)
    for n in methods.names()])
def test_weights_stored_per_layer_give_the_stacked_models_tokens(setup, name):
    """A model whose layers are stored per layer (`Model.with_layers`) runs every method:
    its decode loops over the stored buffers (`auto`, plain step) and every program that
    scans the layers stacks them; tokens and cache equal the stacked model's bit for bit
    (the same math on the same values; measured equal, so no tolerance)."""
    model, prompts, questions = setup
    per = model.with_layers("per_layer")
    assert isinstance(per.params["layers"], tuple) and len(per.params["layers"]) == \
        model.cfg.num_layers
    m = _method(name)
    want = engine.run(model.params, model.cfg, prompts, m, max_new_tokens=6,
                      kernels=Kernels(decode_layers="scan"))
    got = engine.run(per.params, per.cfg, prompts, m, max_new_tokens=6)
    assert got.stats["kernels"]["decode_layers"] == ("per_layer" if m.layered_hooks()
                                                     else "scan")
    assert got.tokens == want.tokens
    _same_cache(got.cache, want.cache, m)
    back = per.with_layers("stacked").params["layers"]
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model.params["layers"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bad_layer_storage_is_refused():
    model = kvjax.load("tiny-retrieval")
    with pytest.raises(ValueError, match=r"layer storage 'rows'; allowed: \('stacked'"):
        model.with_layers("rows")
    # the mesh's shardings are of the stacked weights: a per-layer model is refused there
    from kvjax import distributed

    per = model.with_layers("per_layer")
    with pytest.raises(ValueError, match=r"'per_layer' is for a model on one device.*"
                                         r"allowed on a mesh: 'stacked'"):
        distributed.shard_params(per.params, per.cfg, distributed.make_mesh(1, 1))


def test_an_append_writes_what_the_scatter_writes():
    rng = np.random.default_rng(0)
    L, B, K, C, D, T = 3, 2, 2, 9, 4, 2
    kv = kvcache.LayerKV(jnp.asarray(rng.normal(size=(L, B, K, C, D)), jnp.float32),
                         jnp.asarray(rng.normal(size=(L, B, K, C, D)), jnp.float32),
                         jnp.asarray(rng.integers(0, 50, (L, B, K, C)), jnp.int32),
                         jnp.asarray(rng.random((L, B, K, C)) < 0.5))
    k, v = (jnp.asarray(rng.normal(size=(B, K, T, D)), jnp.float32) for _ in range(2))
    pos, valid = jnp.asarray([[60, 61], [70, 71]]), jnp.asarray([[True, False], [True, True]])
    for start in (0, 4, C - T):
        slots = jnp.broadcast_to(start + jnp.arange(T), (B, K, T))
        for layer, part in ((1, kv), (None, kvcache.LayerKV(*(a[2] for a in kv)))):
            got = kvcache.write(part, layer, k, v, pos, valid, jnp.int32(start))
            want = kvcache.write(part, layer, k, v, pos, valid, slots)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_split_and_stack_layers_round_trip():
    kv = kvcache.LayerKV(*(jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4) + i
                           for i in range(4)))
    parts = kvcache.split_layers(kv)
    assert len(parts) == 2 and parts[1].k.shape == (3, 4)
    for a, b in zip(kvcache.stack_layers(parts), kv):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("layout", ["scan", "per_layer"])
def test_unrolled_decode_gives_the_tokens_of_one_step_an_iteration(setup, layout):
    """`Kernels.decode_unroll`: k plain steps a loop iteration give k = 1's tokens, counts
    and live cache bit for bit, with stops inside an iteration and a max_new that k does
    not divide; a method with decode hooks keeps one step (its state would see the extra
    steps). The steps run after every element stopped only append dead entries."""
    model, prompts, _ = setup
    m = _method("snapkv")
    run = lambda k, stops=(), meth=m: engine.run(  # noqa: E731
        model.params, model.cfg, prompts, meth, max_new_tokens=7, stop_ids=stops,
        kernels=Kernels(decode_layers=layout, decode_unroll=k))
    free = run(1).tokens
    # element 0 stops at its third token, element 1 at its fifth (or where those ids come)
    stops = (free[0][2], free[1][4])
    one = run(1, stops)
    assert min(len(t) for t in one.tokens) < 7  # a stop fired inside the generation
    # k = 3: two iterations of 3 and one single step make max_new 7
    got = run(3, stops)
    assert got.stats["kernels"]["decode_unroll"] == "3"
    assert got.tokens == one.tokens
    assert got.stats["steps_run"] == one.stats["steps_run"]
    live = np.asarray(one.cache.valid)
    np.testing.assert_array_equal(np.asarray(got.cache.valid), live)
    for f in ("k", "v", "pos"):
        np.testing.assert_array_equal(np.asarray(getattr(got.cache, f))[live],
                                      np.asarray(getattr(one.cache, f))[live], err_msg=f)
    if layout == "per_layer":
        return  # a hooked method's single step is checked once, in the scan layout
    hooked = run(3, stops, _method("h2o"))
    assert "decode_unroll" not in hooked.stats["kernels"]
    assert hooked.tokens == run(1, stops, _method("h2o")).tokens


@pytest.mark.parametrize("method", ["full", "h2o"])
def test_decode_returns_the_steps_its_loop_ran(setup, method):
    """What tpot_s divides by: the loop's own step count. Every step appends an entry (dead
    ones after every element stopped), so the cache's end counts them too; k = 3 plain
    steps an iteration run the last iteration to its end while 3 more fit in max_new,
    then single steps; a hook method steps one at a time."""
    model, prompts, _ = setup
    params, cfg, m = model.params, model.cfg, _method(method)
    T = engine.bucket(max(map(len, prompts)))
    tok, val = engine.pad_left(prompts, T, cfg.pad_token_id)
    cap = m.decode_capacity(m.cache_slots(T, cfg), 0, 7)

    def run(k, stops=()):
        logits, cache, state, _ = engine.prefill(params, tok, val, cfg=cfg, method=m,
                                                 capacity=cap)
        end = int(cache.end)
        out, n, cache, _, ran = engine.decode(
            params, cache, logits, jax.random.PRNGKey(0), state, cfg=cfg, method=m,
            max_new=7, sampling=engine.Sampling(), stop_ids=stops,
            kernels=Kernels(decode_unroll=k))
        assert int(ran) == int(cache.end) - end
        return np.asarray(out), int(n.max()), int(ran)

    free, _, ran = run(1)
    assert ran == 7
    stops = (int(free[0, 2]), int(free[1, 4]))  # inside the generation, 7 not a multiple of 3
    _, longest, one = run(1, stops)
    assert one == longest + 1 < 7  # the step that sampled the last stop token ends the loop
    want = -(-one // 3) * 3 if method == "full" and -(-one // 3) * 3 <= 6 else one
    assert run(3, stops)[2] == want



def test_a_bad_unroll_is_refused():
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=r"decode_unroll=.*; allowed: an int >= 1"):
            Kernels(decode_unroll=bad)


def test_a_bad_layout_is_refused():
    with pytest.raises(ValueError, match=r"decode_layers='unrolled'; allowed: \('auto'"):
        Kernels(decode_layers="unrolled")


def test_appends_are_in_place_in_the_compiled_decode():
    """No copy of a layer's K or V (or of the stacked cache) in the decode program: the scan
    at batch 1 and 2, the per-layer loop at batch 2. (The per-layer loop at batch 1 copies on
    CPU: kvjax.bench.decode_hlo, docs/results/speed.md.) The per-layer loop's temporaries
    hold its once-a-call split of the stacked weights and cache; the scan's do not."""
    from kvjax.bench.decode_hlo import cache_copies, decode_program, temp_gib
    from kvjax.bench.gpu import shape_8b

    cfg = shape_8b(2, True, 512)
    prog = {(b, lay): decode_program(cfg, b, 256, lay, jnp.float32)
            for b, lay in ((1, "scan"), (2, "scan"), (2, "per_layer"), (1, "per_layer"))}
    for batch, layout in ((1, "scan"), (2, "scan"), (2, "per_layer")):
        assert cache_copies(prog[batch, layout], cfg, batch, 256, jnp.float32) == 0, \
            (batch, layout)
    # the counter sees the copies where they are
    assert cache_copies(prog[1, "per_layer"], cfg, 1, 256, jnp.float32) > 0
    if temp_gib(prog[2, "scan"]) is None:
        pytest.skip("this backend gives no memory analysis")
    kv = 2 * cfg.num_layers * 2 * cfg.num_kv_heads * 256 * cfg.head_dim * 4 / 2**30
    assert temp_gib(prog[2, "per_layer"]) - temp_gib(prog[2, "scan"]) >= kv


def test_the_layout_probe_computes_one_step_every_way():
    """`kvjax.bench.decode_layout`'s layouts (the GPU probe) are the same step: the scan,
    per-layer buffers and static slices of the stacked arrays, alone and 8 steps in a loop.
    float32, tolerance 1e-5 of the output's scale: the layouts may fuse, so sum, in another
    order (seen: ~1e-7); 1e-4 against 8 scan steps, whose differences feed the next step."""
    import jax

    from kvjax.bench import decode_layout as dl

    L, H, F, K, D, C, B = 3, 32, 64, 2, 8, 40, 2
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 12))
    shapes = [(H, 2 * K * D), (H, K * D), (H, K * D), (2 * K * D, H), (H, F), (H, F), (F, H)]
    w_L = tuple(0.2 * jax.random.normal(next(keys), (L, *s)) for s in shapes)
    k_L, v_L = (jax.random.normal(next(keys), (L, B, K, C, D)) for _ in range(2))
    x = jax.random.normal(next(keys), (B, H))
    ws = [tuple(w[i] for w in w_L) for i in range(L)]
    ks, vs = list(k_L), list(v_L)
    one = np.asarray(dl.step_scan(x, w_L, k_L, v_L))
    tol = dict(rtol=1e-5, atol=1e-5 * np.abs(one).max())
    np.testing.assert_allclose(np.asarray(dl.step_unrolled(x, ws, ks, vs)), one, **tol)
    np.testing.assert_allclose(np.asarray(dl.step_static(x, w_L, k_L, v_L)), one, **tol)
    loop = np.asarray(dl.steps_unrolled(x, ws, ks, vs))
    want = x
    for _ in range(dl.STEPS_IN_LOOP):
        want = dl.step_scan(want, w_L, k_L, v_L)
    np.testing.assert_allclose(loop, np.asarray(want), rtol=1e-4, atol=1e-4 * np.abs(loop).max())
    np.testing.assert_allclose(np.asarray(dl.steps_static(x, w_L, k_L, v_L)), loop, **tol)
