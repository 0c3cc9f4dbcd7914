"""Every registered method keeps the KV entries its budget says, on a model of six layers
(shallower than any paper's: every depth-scaled default is exercised) and on prompts where
the method's own trigger does not fire (ASL never crossing tau falls back; LAVa and CAKE
layers whose share exceeds what they hold pass the excess on).

`--budget B` means, per family (README, docs/methods.md "Conventions"): B entries per layer
and KV head (the SnapKV family, H2O, TOVA, StreamingLLM, RoCo, CaM, ASL, GemFilter);
B x heads per layer (AdaKV); B x heads x layers in total (PyramidKV's schedule, HeadKV's
table, LAVa, CAKE, D2O's layer sizes: up to one entry of rounding per layer and head);
FastKV: B per head before its TSP layer and the propagated tokens after it; SlimInfer and
LazyLLM: B tokens at the last pruning stage (their stats say what each stage kept);
`d2o_code` (the authors' code): nothing is evicted before the first decoding step, which
evicts down to each layer's size S_l in bulk, and the edge layers stay whole.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from kvjax import engine, methods
from kvjax.config import ModelConfig
from kvjax.train import init_params

L, K, H = 6, 2, 4
CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=L, num_heads=H, num_kv_heads=K, head_dim=8,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_ids=(2,))
N, B = 256, 48
# small windows and sinks so that B leaves room to choose
SMALL = {"window": 8, "kernel": 5}


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0), std=0.3)


@pytest.fixture(scope="module")
def head_scores(tmp_path_factory):
    path = tmp_path_factory.mktemp("hs") / "random.json"
    s = np.random.default_rng(0).random((L, H))
    path.write_text(json.dumps({"config": CFG.to_hf(), "head_scores": s.tolist()}))
    return str(path)


def make(name, head_scores):
    fields = set(methods.parameters(name))
    kw = {} if methods.get(name).prefill_kind == "block_pruning" else \
        {k: v for k, v in SMALL.items() if k in fields}
    if "tau" in fields:
        kw["tau"] = 1e-9  # ASL's trigger never fires: its fallback must hold the budget
    if "head_scores" in fields:
        kw["head_scores"] = head_scores
    if name in ("sliminfer", "sliminfer_aggressive", "sliminfer_restrict"):
        kw.update(block=16, unit=4, window=4)
    for f, v in (("n_sink", 4), ("sinks", 4), ("recent", 4)):
        if f in fields:
            kw[f] = v
    return methods.create(name, **kw).with_budget(B)


def live(cache):
    """[L, K] live entries per layer and KV head (one prompt, no decoding)."""
    return np.asarray(cache.valid[:, 0]).sum(-1)


@pytest.mark.parametrize("name", methods.names())
def test_live_entries_match_the_budget(params, head_scores, name):
    m = make(name, head_scores)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, CFG.vocab_size, N)]
    new = 1 if name == "d2o_code" else 0  # the code evicts at the first decoding step
    g = engine.run(params, CFG, [ids], m, max_new_tokens=new, stop_ids=())
    got, st = live(g.cache), g.stats
    if name == "d2o_code":
        sizes, whole = np.asarray(st["layer_sizes"][0]), np.asarray(st["layer_whole"][0], bool)
        assert np.all(got[whole] == N + new) and whole[0] and whole[1] and whole[-1]
        assert np.all(got[~whole] == sizes[~whole, None]), (got, sizes)
    elif name == "full":
        assert np.all(got == N)
    elif name in ("ada_snapkv", "critical_adakv"):
        assert np.all(got.sum(1) == K * B)  # the layer's flattened total
    elif name == "ada_pyramidkv":
        assert abs(int(got.sum()) - L * K * B) <= L * K
    elif name == "lava_code":  # the authors' per-head int() budgets and safeguard floor do
        # not hold the total (docs/methods.md "LAVa"): 3200 of 3072 at budget 128
        assert abs(int(got.sum()) - L * K * B) <= 0.1 * L * K * B, (got.sum(), L * K * B)
    elif name in ("pyramidkv", "critical_pyramidkv", "headkv", "critical_headkv", "lava",
                  "lava_heads_only", "lava_layers_only", "cake", "critical_lava", "d2o",
                  "d2o_no_merge"):  # d2o_uniform_layers: every layer at the budget
        assert abs(int(got.sum()) - L * K * B) <= L * K, (got.sum(), L * K * B)
    elif name == "fastkv":
        tsp = st["selection_layer"][0]
        assert np.all(got[: tsp + 1] == st["kv_budget"][0])
        assert np.all(got[tsp + 1:] == st["select_k"][0])
    elif name in ("sliminfer", "sliminfer_aggressive", "sliminfer_restrict", "lazyllm"):
        last = st["stage_tokens"][0][-1]
        assert last == B and np.all(got[-1] == B), (st["stage_tokens"], got)
    else:  # uniform per layer and head, forced entries included
        assert np.all(got == B), got
        if name.startswith("asl"):
            assert st["selected"] == [False] and st["fallback_snapkv"] == [True]
