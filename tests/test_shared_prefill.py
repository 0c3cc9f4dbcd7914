"""One prefill, many methods (`kvjax.engine.shared`): a method replayed on the recorded full
prefill gives what its own prefill gives, on the bundled model."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.cli import main as cli
from kvjax.engine import shared

SHARING = [n for n in methods.names() if shared.shares(methods.create(n))]
# in the fast suite: window attention, per-head budgets, accumulated columns, cross-layer
# allocation, position only (a query-less hook); the rest (merging, the critical rule, ...)
# with -m slow
FAST = {"snapkv", "ada_snapkv", "h2o", "lava", "streaming_llm"}


@pytest.fixture(scope="module")
def setup():
    model = kvjax.load("tiny-retrieval")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, model.cfg.vocab_size, n).tolist() for n in (300, 270, 290)]
    return model, prompts, shared.prefill(model.params, model.cfg, prompts)


def _at_budget(name):
    m = methods.create(name)
    return m.with_budget(64) if m.takes_budget() else m


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
                                  for n in SHARING])
def test_replayed_compression_equals_the_methods_own_prefill(setup, name):
    model, prompts, pre = setup
    m = _at_budget(name)
    own = engine.run(model.params, model.cfg, prompts, m, max_new_tokens=8)
    rep = engine.run(model.params, model.cfg, prompts, m, max_new_tokens=8, prefilled=pre)
    assert rep.tokens == own.tokens
    # the same entries kept, at the same slots
    for f in ("pos", "valid", "end", "next_pos"):
        np.testing.assert_array_equal(np.asarray(getattr(rep.cache, f)),
                                      np.asarray(getattr(own.cache, f)), err_msg=f)
    # Equal floats for every method that reads the queries; for those that do not (full,
    # StreamingLLM, CAM) XLA lays the layer out differently in the two programs and the
    # keys differ by ~1e-5 (float32 rounding of the same sums; measured 1.1e-5 at most):
    # rtol 1e-4 allows that and nothing a different computation would give
    for f in ("k", "v"):
        np.testing.assert_allclose(np.asarray(getattr(rep.cache, f)),
                                   np.asarray(getattr(own.cache, f)), rtol=1e-4, atol=1e-4)
    for k, v in own.stats.items():
        if k not in engine.ENGINE_STATS:
            assert json.dumps(rep.stats[k], default=str) == json.dumps(v, default=str), k
    assert rep.stats["ttft_own_s"] is not None and own.stats["ttft_own_s"] is None
    assert rep.stats["ttft_s"] >= pre.prefill_s


def test_methods_that_change_the_prefill_do_not_share():
    for name in ("asl", "fastkv", "gemfilter", "sliminfer", "lazyllm"):
        assert not shared.shares(methods.create(name)), name


def test_a_prefill_is_refused_for_other_prompts_or_methods(setup):
    model, prompts, pre = setup
    with pytest.raises(ValueError, match=r"recorded for other prompts .*\(3, 320\)"):
        engine.run(model.params, model.cfg, [prompts[0][:-1], *prompts[1:]], _at_budget(
            "snapkv"), max_new_tokens=1, prefilled=pre)
    with pytest.raises(ValueError, match="'asl' changes the prefill itself"):
        engine.run(model.params, model.cfg, prompts, methods.create("asl"),
                   max_new_tokens=1, prefilled=pre)


def test_run_methods_equals_each_run(setup):
    model, prompts, _ = setup
    ms = [_at_budget("snapkv"), methods.create("gemfilter", select_k=64), _at_budget("h2o")]
    gens = engine.run_methods(model.params, model.cfg, prompts, ms, max_new_tokens=4)
    for m, g in zip(ms, gens):
        assert g.tokens == engine.run(model.params, model.cfg, prompts, m,
                                      max_new_tokens=4).tokens
    # two methods compress after the full prefill: it runs once, for both
    assert [g.stats["ttft_own_s"] is not None for g in gens] == [True, False, True]
    one = engine.run_methods(model.params, model.cfg, prompts, ms[:2], max_new_tokens=1)
    assert [g.stats["ttft_own_s"] for g in one] == [None, None]  # one alone: its own


@pytest.mark.slow  # ~50 s on CI; test_a_ratio_sweep_shares_the_prefill checks the same in
# the fast suite, and test_run_methods_equals_each_run a method that runs its own beside
def test_a_shared_sweep_writes_the_records_of_separate_runs(tmp_path):
    argv = ["--model", "tiny-retrieval", "--method", "snapkv,streaming_llm,gemfilter", "--budget", "64",
            "--task", "passkey", "--context", "256", "--samples", "3", "--batch-size", "2",
            "--details", "--no-progress"]
    assert cli.main([*argv, "--output", str(tmp_path / "s.jsonl")]) == 0
    assert cli.main([*argv, "--no-share-prefill", "--output", str(tmp_path / "o.jsonl")]) == 0
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    s, o = read(tmp_path / "s.jsonl"), read(tmp_path / "o.jsonl")
    assert [(r["method"], r["budget"]) for r in s] == [(r["method"], r["budget"]) for r in o]
    for a, b in zip(s, o):
        assert [d["prediction"] for d in a["details"]] == [d["prediction"] for d in b["details"]]
        assert a["accuracy"] == b["accuracy"] and a["kv_bytes_live"] == b["kv_bytes_live"]
        assert b["prefill"] == "own" and b["ttft_own_s"] is None
        assert a["prefill"] == ("own" if a["method"] == "gemfilter" else "shared")
        assert (a["ttft_own_s"] is None) == (a["method"] == "gemfilter")


def test_a_prefill_s_rows_replay_as_their_own_prefill(setup):
    """`Prefilled.take`: rows of a recorded batch (the shorter one's padding cut from 320
    to 224 columns) give what those prompts' own prefill gives."""
    model, _, _ = setup
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, model.cfg.vocab_size, n).tolist() for n in (300, 200, 290)]
    pre = shared.prefill(model.params, model.cfg, prompts)
    m = _at_budget("snapkv")
    for rows in ([1], [0, 2], [2, 1]):
        part = pre.take(rows)
        mine = [prompts[r] for r in rows]
        own = engine.run(model.params, model.cfg, mine, m, max_new_tokens=6)
        rep = engine.run(model.params, model.cfg, mine, m, max_new_tokens=6, prefilled=part)
        assert rep.tokens == own.tokens, rows
        for f in ("pos", "valid", "end"):
            np.testing.assert_array_equal(np.asarray(getattr(rep.cache, f)),
                                          np.asarray(getattr(own.cache, f)), err_msg=f)
    assert pre.take([1]).tokens.shape == (1, 224)


def test_a_ratio_sweep_shares_the_prefill(tmp_path):
    """`--ratio`: each prompt its own budget, so a chunk's samples split into batches by
    budget; they replay the chunk's one prefill, and write what separate runs write."""
    from kvjax import tasks

    model = kvjax.load("tiny-retrieval")
    f = tmp_path / "passkey" / "validation.jsonl"
    f.parent.mkdir()
    lines = []
    for i, n in enumerate((256, 200, 160, 240)):  # four lengths: four budgets at ratio 0.5
        (smp,) = tasks.fit("passkey", n, lambda s: len(model.encode(s.prompt)), n=1, seed=i)
        lines.append(json.dumps({"index": i, "input": smp.prompt, "outputs": list(smp.answer),
                                 "length": n}))
    f.write_text("\n".join(lines) + "\n")
    argv = ["--model", "tiny-retrieval", "--method", "full,snapkv", "--ratio", "0.5",
            "--task", f"ruler:{f}", "--batch-size", "2", "--details", "--no-progress"]
    assert cli.main([*argv, "--output", str(tmp_path / "s.jsonl")]) == 0
    assert cli.main([*argv, "--no-share-prefill", "--output", str(tmp_path / "o.jsonl")]) == 0
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    s, o = read(tmp_path / "s.jsonl"), read(tmp_path / "o.jsonl")
    assert [r["method"] for r in s] == ["full", "snapkv"]
    assert len(set(s[1]["budget"])) == 4
    for a, b in zip(s, o):
        assert (a["prefill"], b["prefill"]) == ("shared", "own")
        assert [d["prediction"] for d in a["details"]] == [d["prediction"] for d in b["details"]]
        assert a["kv_bytes_live"] == b["kv_bytes_live"]


def test_generate_each_equals_generate():
    model = kvjax.load("tiny-retrieval")
    prompt = "the key is 31415. " * 30 + "what is the key?"
    got = kvjax.generate_each(model, prompt, ["snapkv", "streaming_llm"], max_new_tokens=4)
    for name, r in zip(("snapkv", "streaming_llm"), got):
        assert r.tokens == kvjax.generate(model, prompt, name, max_new_tokens=4).tokens
        assert r.stats["ttft_own_s"] is not None
