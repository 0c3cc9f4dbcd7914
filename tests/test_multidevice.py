"""Multi-device runs on 8 emulated CPU devices give the single-device results.

- the compression step per device (`kvjax.distributed.shard_heads`, a `jax.shard_map` over
  the KV heads) keeps the single-device entries and gives the single-device tokens for
  SnapKV, Ada-SnapKV (flattened top-k across devices), LAVa (flattened ranks and layer
  budgets across devices) and H2O (decode-time eviction), on (8, 1), (4, 2), (2, 4) (CI:
  one mesh for each of SnapKV, Ada-SnapKV and H2O; `-m slow` runs them all);
- the cross-device top-k and ranks equal the single-device ones on scores full of ties;
- a batch of 3 on data=2 is padded and gives the same tokens and statistics;
- `kvjax.load(..., mesh=)` puts each weight on its shards; `generate(mesh=...)`, the
  CLI's `--mesh` and its errors.

The device count is fixed when jax initialises, so the 8-device checks run in one
subprocess (small model, short prompts: CI has 2 cores).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import contextlib, io, json, os, sys, tempfile
    FULL = sys.argv[1:] == ["full"]  # every method on every mesh; else a part (CI's time)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.sharding import PartitionSpec as P
    import kvjax
    from kvjax import distributed, engine, methods, run
    from kvjax.compression import budgets
    from kvjax.compression.heads import Heads, flat_top_mask
    from kvjax.config import ModelConfig
    from kvjax.methods.lava import cascade
    from kvjax.train import export_model, init_params
    assert len(jax.devices()) == 8

    # ---- the collectives on scores full of ties (+-inf included) ----
    rng = np.random.default_rng(0)
    B, K, n = 2, 8, 11
    s = rng.integers(0, 3, (B, K, n)).astype(np.float32)
    s[rng.random(s.shape) < 0.1] = -np.inf
    s_inf = np.where(rng.random(s.shape) < 0.05, np.inf, s).astype(np.float32)
    total = rng.integers(1, 4 * K, B)
    b, ns, base = rng.integers(1, 5, (B, 1)), rng.integers(0, 3, B), rng.integers(1, 9, B)
    hr = cascade.head_rank(jnp.asarray(s))
    rows = lambda x: jnp.broadcast_to(jnp.asarray(x).reshape(B, 1), (B, K))
    H = Heads("model")
    checks = {
        "flat_top_mask": (lambda x, t: flat_top_mask(x, t[:, 0], 4 * K, H),
                          flat_top_mask(jnp.asarray(s_inf), jnp.asarray(total), 4 * K),
                          (s_inf, rows(total))),
        "flattened_heads": (
            lambda x, bb, nn: budgets.flattened_heads(x, bb[:, :1], nn[:, 0], 4, 2, heads=H),
            budgets.flattened_heads(jnp.asarray(s_inf), jnp.asarray(b), jnp.asarray(ns), 4, 2),
            (s_inf, rows(b), rows(ns))),
        "adakv_code_counts": (
            lambda x, bb: budgets.adakv_code_counts(x, bb[:, 0], 0.2, H),
            budgets.adakv_code_counts(jnp.asarray(s), jnp.asarray(base), 0.2), (s, rows(base))),
    }
    for cap in (3, n):
        checks[f"flat_rank cap={cap}"] = (
            lambda x, h, cap=cap: cascade.flat_rank(x, h < cap, H, cap),
            cascade.flat_rank(jnp.asarray(s), hr < cap), (s, hr))
        checks[f"cap_rank cap={cap}"] = (
            lambda x, h, cap=cap: cascade.cap_rank(x, h, cap, H),
            cascade.cap_rank(jnp.asarray(s), hr, cap), (s, hr))
    for M in (2, 8):
        mesh = distributed.make_mesh(8 // M, M)
        for what, (f, ref, args) in checks.items():
            got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "model"),) * len(args),
                                        out_specs=P(None, "model"), check_vma=False))(*args)
            assert np.array_equal(np.asarray(ref), np.asarray(got)), (what, M)

    # ---- engine.run on meshes: kept sets, budgets and tokens of one device ----
    cfg = ModelConfig(family="llama", vocab_size=1408, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
                      max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    prompts = [list(rng.integers(3, 64, m)) for m in (40, 33, 57, 21, 48, 60, 36, 44)]

    def kept(g):
        return np.sort(np.where(np.asarray(g.cache.valid), np.asarray(g.cache.pos), -1), -1)

    run_kw = dict(max_new_tokens=3, stop_ids=())
    # each mesh shape with a head-split (shard_map) and a data-only compression; not every
    # method on every mesh (the CI budget): 3 runs fast, 6 in full, each against one device
    for name, kw, meshes in [("snapkv", dict(budget=12, window=4), [(4, 2)]),
                             ("ada_snapkv", dict(budget=12, window=4),
                              [(8, 1), (2, 4)] if FULL else [(2, 4)]),
                             ("lava", dict(budget=12, window=4), [(2, 4)] if FULL else []),
                             ("h2o", dict(budget=12), [(8, 1), (4, 2)] if FULL else [(8, 1)])]:
        if not meshes:
            continue
        m = methods.create(name, **kw)
        ref = engine.run(params, cfg, prompts, m, **run_kw)
        for data, model in meshes:
            mesh = distributed.make_mesh(data, model)
            g = engine.run(params, cfg, prompts, m, mesh=mesh, **run_kw)
            where = (name, data, model)
            assert g.tokens == ref.tokens, where
            assert np.array_equal(kept(g), kept(ref)), where
            assert g.stats["layer_budgets"] == ref.stats["layer_budgets"], where
            assert g.stats["kv_bytes_live"] == ref.stats["kv_bytes_live"], where
            want = "shard_map" if model > 1 else "xla"
            assert g.stats["mesh"] == {"data": data, "model": model, "compression": want}, where
            spec = tuple(g.cache.k.sharding.spec) + (None,) * 5
            assert spec[1:3] == ("data", "model" if model > 1 else None), (where, spec)
            if name == "lava":  # sums over heads in another order: last-bit differences
                np.testing.assert_allclose(g.stats["layer_weight"], ref.stats["layer_weight"],
                                           rtol=1e-5)

    # ---- a batch of 3 on data=2: padded, the same tokens and statistics ----
    m = methods.create("ada_snapkv", budget=12, window=4)
    ref = engine.run(params, cfg, prompts[:3], m, **run_kw)
    g = engine.run(params, cfg, prompts[:3], m, mesh=distributed.make_mesh(2, 4), **run_kw)
    assert g.tokens == ref.tokens and len(g.tokens) == 3
    assert g.cache.k.shape[1] == 3 and np.array_equal(kept(g), kept(ref))
    for k in ("layer_budgets", "kv_bytes_live", "kv_bytes_allocated", "kv_bytes_full",
              "prompt_tokens"):
        assert g.stats[k] == ref.stats[k], k
    if FULL:  # context-only on a mesh, an Explicit-axes mesh, a decode statistic
        q = [list(rng.integers(3, 64, 5)) for _ in range(3)]  # context-only, padded too
        ref_q = engine.run(params, cfg, prompts[:3], m, questions=q, **run_kw)
        g = engine.run(params, cfg, prompts[:3], m, questions=q, mesh=distributed.make_mesh(2, 2),
                       **run_kw)
        assert g.tokens == ref_q.tokens
        # a mesh from jax.make_mesh (Explicit axes) is taken as the same devices with Auto axes
        explicit = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
        g = engine.run(params, cfg, prompts[:3], m, mesh=explicit, **run_kw)
        assert g.tokens == ref.tokens

        # ---- a decode statistic of a padded batch: the padding's rows dropped ----
        d = methods.create("d2o_code", budget=12, full_first=0, full_last=0)
        ref_d = engine.run(params, cfg, prompts[:3], d, **run_kw)
        g = engine.run(params, cfg, prompts[:3], d, mesh=distributed.make_mesh(2, 1), **run_kw)
        assert g.tokens == ref_d.tokens
        per_element = [k for k, v in ref_d.stats.items() if isinstance(v, list) and len(v) == 3]
        assert "budget_gap" in per_element, sorted(ref_d.stats)
        for k in per_element:
            assert len(g.stats[k]) == 3, k

    # ---- load straight into shards; generate / compress with mesh= ----
    tmp = tempfile.mkdtemp()
    export_model(tmp, cfg, params, {"model": {}})  # with the task tokenizer, for the CLI
    sharded = kvjax.load(tmp, mesh="data=2,model=4")
    whole = kvjax.load(tmp)
    assert sharded.mesh.shape == {"data": 2, "model": 4}
    heads_axis = {"q": 2, "k": 2, "v": 2, "o": 1, "gate": 2, "up": 2, "down": 1}
    for k, x in sharded.params["layers"].items():
        want = [None] * x.ndim
        if k in heads_axis:
            want[heads_axis[k]] = "model"
        assert tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec)) == \\
            tuple(want), (k, x.sharding.spec)
        shard = x.addressable_shards[0].data.shape
        assert shard[heads_axis.get(k, 0)] == x.shape[heads_axis.get(k, 0)] // (
            4 if k in heads_axis else 1), (k, shard)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(whole.params["layers"][k]))
    assert sharded.params["embed"].sharding.spec == P()
    r1 = kvjax.generate(sharded, prompts[:3], m, **run_kw)  # on the model's mesh
    assert r1.tokens == ref.tokens and r1.stats["mesh"]["compression"] == "shard_map"
    r2 = kvjax.generate(whole, prompts[0], m, mesh="data=1,model=2", **run_kw)
    assert r2.tokens == ref.tokens[0]
    cache, stats = kvjax.compress(whole, prompts[:3], m, mesh=sharded.mesh)
    assert cache.k.shape[1] == 3 and stats["mesh"]["data"] == 2
    try:
        kvjax.load(tmp, mesh="data=1,model=8")  # 8 does not divide the 4 KV heads
        raise SystemExit("a mesh that does not divide the heads was accepted")
    except ValueError as e:
        assert "must divide" in str(e), e

    # ---- the CLI: --mesh records, the same predictions, errors in one line ----
    def cli(*argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = run.main(list(argv))
        return rc, err.getvalue().strip().splitlines()

    base = ["--model", tmp, "--method", "snapkv", "--budget", "48", "--task", "passkey",
            "--context", "128", "--samples", "3", "--max-new-tokens", "3", "--no-progress",
            "--details", "--overwrite"]
    with tempfile.TemporaryDirectory() as d:
        for tag, extra in (("one", []), ("mesh", ["--mesh", "data=2,model=2"])):
            rc, lines = cli(*base, "--output", f"{d}/{tag}.json", *extra)
            assert rc == 0, (tag, lines[-3:])
        one, two = (json.load(open(f"{d}/{t}.json"))["records"][0] for t in ("one", "mesh"))
    assert one["mesh"] is None
    assert two["mesh"] == {"data": 2, "model": 2, "compression": "shard_map"}, two["mesh"]
    assert [x["prediction"] for x in one["details"]] == [x["prediction"] for x in two["details"]]
    assert two["job"]["mesh"] == "data=2,model=2" and "mesh" not in one["job"]
    for argv, says in ((["--mesh", "data=16,model=1"], "needs 16 devices"),
                       (["--mesh", "data=1,model=8"], "must divide"),
                       (["--mesh", "model=2"], "data=D,model=M")):
        rc, lines = cli(*base, *argv)
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:"), (argv, lines)
        assert says in lines[0], (argv, lines)
    print("OK")
""")


def _script(*argv: str) -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])


def test_meshes_give_the_single_device_results():
    """A mesh of each kind per method family (SnapKV, Ada-SnapKV, H2O), the padded batch,
    loading into shards, the CLI."""
    _script()


@pytest.mark.slow  # ~30 s more: LAVa, the other meshes, context-only, d2o's statistics
def test_meshes_give_the_single_device_results_everywhere():
    _script("full")


def test_pad_batch_and_parse_mesh():
    from kvjax import distributed

    assert distributed.parse_mesh(" data=4, model=2 ") == (4, 2)
    for bad in ("model=2", "data=0,model=1", "data=2;model=2", "data=a,model=1"):
        with pytest.raises(ValueError, match="data=D,model=M"):
            distributed.parse_mesh(bad)
    p, q = distributed.pad_batch([[1], [2, 3], [4]], [[5], [6], [7]], 2)
    assert p == [[1], [2, 3], [4], [4]] and q == [[5], [6], [7], [7]]
    p, q = distributed.pad_batch([[1], [2]], None, 2)
    assert p == [[1], [2]] and q is None
    assert distributed.as_mesh(None) is None
    with pytest.raises(TypeError, match="Mesh"):
        distributed.as_mesh(3)


@pytest.mark.slow  # a benchmark's run (~25 s); the meshes' results are tested above
def test_scaling_benchmark_runs_every_mesh(tmp_path):
    """`python -m kvjax.bench.multidevice` on 4 emulated devices: a row per method and mesh,
    each mesh's tokens equal to one device's (the speed figures are not checked: emulated
    devices share the cores)."""
    import os

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    r = subprocess.run([sys.executable, "-m", "kvjax.bench.multidevice", "--context", "128",
                        "--batch", "4", "--layers", "1", "--hidden", "128", "--intermediate",
                        "256", "--heads", "8", "--kv-heads", "4", "--head-dim", "16", "--vocab",
                        "256", "--budget", "48", "--new-tokens", "2", "--methods",
                        "full,ada_snapkv"], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines()
            if line.split()[:1] in (["full"], ["ada_snapkv"])]
    # default meshes for 4 devices: 1x1, 4x1, 1x4, 2x2
    assert [(row[0], row[1]) for row in rows] == [
        (m, s) for m in ("full", "ada_snapkv") for s in ("1x1", "4x1", "1x4", "2x2")]
    assert all(row[-1] == "True" for row in rows), r.stdout


HOST_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    port, pid = sys.argv[1], int(sys.argv[2])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid)
    import numpy as np
    from kvjax import distributed, engine, methods
    from kvjax.config import ModelConfig
    from kvjax.train import init_params
    assert jax.process_count() == 2 and len(jax.devices()) == 4
    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
                      max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 64, m)) for m in (40, 33, 57)]  # 3: padded to 4
    mesh = distributed.make_mesh(2, 2)
    for name in ("snapkv", "ada_snapkv"):
        m = methods.create(name, budget=20, window=4)
        one = engine.run(params, cfg, prompts, m, max_new_tokens=3, stop_ids=())
        g = engine.run(params, cfg, prompts, m, mesh=mesh, max_new_tokens=3, stop_ids=())
        assert g.tokens == one.tokens, (name, g.tokens, one.tokens)
        assert g.stats["kv_bytes_live"] == one.stats["kv_bytes_live"], name
    try:
        distributed.make_mesh(1, 2)
        raise AssertionError("a mesh leaving a process out was accepted")
    except ValueError as e:
        assert "every process's devices" in str(e)
    print("OK", pid)
""")


@pytest.mark.slow  # ~40 s on CI; one process's meshes are tested in the fast suite
def test_two_processes_give_the_single_device_results():
    """Multi-host, emulated: two processes on this machine (`jax.distributed.initialize`
    over localhost, 2 CPU devices each) run a (2, 2) mesh; each gets the single-device
    tokens and statistics (results sharded over the other process are gathered), and a mesh
    that would leave a process out is refused."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, port, str(pid)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for pid in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for pid, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {pid}" in out, (pid, out[-1000:], err[-3000:])


def test_scaling_benchmark_meshes_fit_the_model():
    """The default meshes keep only those whose model axis divides the KV heads (and MLP
    width); a given one that does not is one error line before anything runs."""
    from kvjax.bench import multidevice

    assert multidevice._meshes(None, 8, lambda m: 4 % m == 0) == [(1, 1), (8, 1), (4, 2)]
    assert multidevice._meshes(None, 1, lambda m: True) == [(1, 1)]
    assert multidevice._meshes("2x2, 1x1", 8, lambda m: True) == [(2, 2), (1, 1)]
    with pytest.raises(SystemExit, match="error: mesh 'x2' is not DxM"):
        multidevice._meshes("x2", 8, lambda m: True)
    with pytest.raises(SystemExit, match="model=2 must divide the KV heads"):
        multidevice.main(["--meshes", "1x2", "--kv-heads", "1", "--heads", "2"])
