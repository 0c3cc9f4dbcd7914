"""8 emulated CPU devices: a (data=2, model=2) and a (4, 2) mesh give the single-device
tokens, with the KV cache split over heads. Runs in a subprocess because the device count
is fixed when jax initialises."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from kvjax import distributed, engine, methods
    from kvjax.config import ModelConfig
    from kvjax.train import init_params
    assert len(jax.devices()) == 8
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=12, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 64, n)) for n in (40, 33, 57, 21, 48, 60, 36, 44)]
    for name, kw in [("full", {}), ("asl", dict(select_k=20, window=4, tau=0.99, fallback_layer=6))]:
        m = methods.create(name, **kw)
        ref = engine.run(params, cfg, prompts, m, max_new_tokens=6, stop_ids=())
        for data, model in [(2, 2), (4, 2), (8, 1)]:
            mesh = distributed.make_mesh(data, model, jax.devices()[: data * model])
            sp = distributed.shard_params(params, cfg, mesh)
            g = engine.run(sp, cfg, prompts, m, max_new_tokens=6, stop_ids=(),
                           batch_sharding=distributed.batch_sharding(mesh))
            assert g.tokens == ref.tokens, (name, data, model)
            shards = g.cache.k.sharding.shard_shape(g.cache.k.shape)
            assert shards[1] == len(prompts) // data and shards[2] == cfg.num_kv_heads // model, shards
    print("OK")
""")


# slow: the fast suite runs the same equality through `mesh=` (tests/test_multidevice.py);
# this one keeps the older `batch_sharding=` form and ASL's token-selection prefill
@pytest.mark.slow
def test_sharded_runs_match_single_device():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
