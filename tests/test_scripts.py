"""The scripts that write docs/results/ and MODEL.md's tables run outside CI (minutes to
hours each); this holds every one of them to importing and parsing its arguments, so a
renamed API or option breaks here first."""

import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "scripts").glob("*.py"))


def test_scripts_found():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_script_help(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.syspath_prepend(str(path.parent))
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(path), run_name="__main__")
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_results_intervals(monkeypatch):
    """The t quantile behind the perplexity and perturbation intervals against the table
    (0.975: df 7 2.365, df 11 2.201, df 29 2.045), and an interval that covers its mean."""
    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import smollm2_results as s

    for n, t in ((8, 2.365), (12, 2.201), (30, 2.045)):
        assert abs(s._t95(n) - t) < 0.01, (n, s._t95(n))
    m, lo, hi = s._mean_ci([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    assert m == 4.5 and abs((hi - m) - 2.365 * 2.449 / 8**0.5) < 0.02 and lo == 2 * m - hi


def test_claim_ids_name_the_comparison_not_its_results(monkeypatch):
    """A claim's id is a hash of what it compares: the registry's ids are that hash and
    distinct, a grown record (new n, new verdict) keeps its id, another arm gets another."""
    import json

    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import smollm2_results as s

    rows = [json.loads(x) for x in (s.ROOT / "docs" / "results" / "claims.jsonl")
            .read_text().splitlines() if x.strip()]
    assert [r["id"] for r in rows] == [s.claim_id(r) for r in rows]
    assert len({r["id"] for r in rows}) == len(rows)
    r = rows[0]
    assert s.claim_id({**r, "n": r["n"] + 10, "a_wins": 0, "verdict": "cannot tell",
                       "metric": "score"}) == r["id"]
    assert s.claim_id({**r, "a": r["a"] + "x"}) != r["id"]


def test_each_model_registers_its_own_claims(monkeypatch):
    """The same comparison (methods, budget, task, samples) on two models is two registry
    rows: records are keyed without their model, and the 1.5B's key sweep once read the
    0.5B's rows of the same samples."""
    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import smollm2_results as s

    def rec(model, method, score):
        return {"model": model, "method": method, "scenario": "question_aware",
                "context_length": 4096, "task": "ruler/niah_multikey_2", "seed": 0,
                "samples": 4, "budget": None if method == "full" else 512, "ratio": None,
                "params": {}, "_files": [f"{model}.jsonl"],
                "details": [{"answer": [str(i)], "depth": i, "score": score} for i in range(4)]}

    monkeypatch.setattr(s, "REGISTRY", [])
    monkeypatch.setitem(s.PAGE, "name", "baselines")
    i = s._register([rec("m1", "snapkv", 1.0)], [rec("m1", "full", 1.0)], "1/8", "question_aware")
    j = s._register([rec("m2", "snapkv", 0.0)], [rec("m2", "full", 1.0)], "1/8", "question_aware")
    assert i != j and [r["model"] for r in s.REGISTRY] == ["m1", "m2"]
    assert s._register([rec("m1", "snapkv", 1.0)], [rec("m1", "full", 1.0)], "1/8",
                       "question_aware") == i  # one comparison read on two pages: one row


def test_a_declared_comparison_without_records_is_said(monkeypatch):
    """A declared pair whose arm has no record is named under the page's table (it once
    vanished from the page), and a pair with both arms is judged as before."""
    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import smollm2_results as s

    def rec(method, budget):
        return {"model": "m", "method": method, "scenario": "question_aware",
                "context_length": 1024, "task": "niah_single", "seed": 0, "samples": 2,
                "budget": budget, "ratio": None, "params": {}, "_files": ["x.jsonl"],
                "details": [{"answer": ["1"], "depth": i, "score": 1.0} for i in range(2)]}

    monkeypatch.setattr(s, "REGISTRY", [])
    monkeypatch.setattr(s, "TABLES", [])
    monkeypatch.setitem(s.PAGE, "name", "baselines")
    recs = [rec("snapkv", 128), rec("h2o", 128)]
    out = s.claims(recs, [("snapkv", "h2o", {}, {}), ("tova", "h2o", {}, {}),
                          ("pyramidkv", "tova", {}, {})], [(128, "1/8")])
    assert out.startswith("@@claims-table-0@@") and s.TABLES == [[0]]
    assert out.endswith("Declared, not measured here: 2 comparisons, no records of "
                        "pyramidkv, tova at these budgets."), out
    assert s.claims(recs, [("snapkv", "h2o", {}, {})], [(64, "1/16")]) == (
        "Declared, not measured here: 1 comparison, no records of h2o, snapkv at these budgets.")


def test_results_pooling_and_sweep_time(monkeypatch):
    """LAVa's average over tasks pools each method's samples of every task (a method
    missing from one task drops out); a sweep's minutes count a shared prefill once per
    group of jobs that shared it, each job's own compression and decode per batch."""
    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import smollm2_results as s

    def rec(method, task, scores, **kw):
        return {"method": method, "scenario": "question_aware", "budget": 8, "task": task,
                "method_params": {"kernel": 17}, "details": [{"score": x} for x in scores],
                **kw}

    a = [rec("lava", "t1", [1, 1]), rec("snapkv", "t1", [0, 1]), rec("cake", "t1", [1, 0])]
    b = [rec("lava", "t2", [0, 1]), rec("snapkv", "t2", [0, 0])]
    pooled = {r["method"]: [d["score"] for d in r["details"]] for r in s._pooled([a, b])}
    assert pooled == {"lava": [1, 1, 0, 1], "snapkv": [0, 1, 0, 0]}

    shared = dict(samples=16, max_new_tokens=10, tpot_s=0.5, compile_s=6.0, prefill="shared",
                  context_length=2048)  # 2 batches of 8: prefill 30 s, own 6 s / 12 s
    recs = [rec("snapkv", "t1", [], ttft_s=36.0, ttft_own_s=6.0, **shared),
            rec("tova", "t1", [], ttft_s=42.0, ttft_own_s=12.0, **shared)]
    want = 2 * 30.0 + 2 * (6 + 5) + 2 * (12 + 5) + 2 * 6.0
    minutes, exact = s._sweep_minutes(recs)  # no step counts: max_new_tokens, an upper bound
    assert abs(minutes - want / 60) < 1e-9 and not exact
    assert s._minutes_text(recs).startswith(f"at most {want / 60:.0f} min on 2 cores: decoding "
                                            "counted")
    # with the steps each record ran (3 and 4 over its 2 batches), the decode is exact
    recs = [dict(r, steps_run=k, batches=2) for r, k in zip(recs, (3, 4))]
    want = 2 * 30.0 + 2 * 6 + 3 * 0.5 + 2 * 12 + 4 * 0.5 + 2 * 6.0
    minutes, exact = s._sweep_minutes(recs)
    assert abs(minutes - want / 60) < 1e-9 and exact
    assert s._minutes_text(recs) == f"{want / 60:.0f} min on 2 cores"  # no `at most`, no why


def _qwen_renderer(monkeypatch, tmp_path, page: str):
    """scripts/smollm2_results.py reading Qwen records from tmp_path, rendering `page`, with
    an empty claims registry."""
    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import smollm2_results as s

    monkeypatch.setattr(s, "ROOT", tmp_path)
    monkeypatch.setattr(s, "QWEN", tmp_path)
    (tmp_path / "docs" / "results").mkdir(parents=True)  # the plots
    monkeypatch.setattr(s, "REGISTRY", [])
    monkeypatch.setattr(s, "TABLES", [])
    monkeypatch.setitem(s.PAGE, "name", page)
    return s


def test_qwen_kernel_is_chosen_on_the_dev_samples_and_read_by_the_papers(monkeypatch,
                                                                          tmp_path):
    """The Qwen kernel: the better mean of SnapKV and Ada-SnapKV on RULER's dev samples,
    7 on a tie, none before both sweeps are complete; the papers' comparisons read the
    methods with a kernel at the chosen one and take full, H2O and StreamingLLM from the
    baselines sweep of the same task."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "lava")

    def rec(method, budget, scores, skip, **params):
        return {"method": method, "budget": budget, "scenario": "question_aware",
                "samples": len(scores), "accuracy": sum(scores) / len(scores), "seed": 0,
                "task": "ruler/t", "context_length": 4096, "ruler_skip": skip,
                "model": "qwen2.5-coder-0.5b", "model_weights": {"sha256": "ab" * 32},
                "method_params": {"budget": budget, **params}, "kv_fraction": 0.1,
                "ttft_s": 1.0, "ttft_own_s": 0.1, "tpot_s": 0.1, "prefill": "shared",
                "details": [{"score": x} for x in scores]}

    def write(name, recs):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))

    def dev(k, hits):
        write(f"dev_pool_k{k}_t_4096.jsonl",
              [rec(m, b, [1] * hits + [0] * (50 - hits), 66, kernel=k)
               for m in ("snapkv", "ada_snapkv") for b in (512, 256)])

    chosen = lambda: (s.qwen_dev_kernel.cache_clear(), s.qwen_dev_kernel("t"))[1]  # noqa: E731
    dev(7, 5)
    assert chosen()[0] is None  # kernel 17's sweep missing
    dev(17, 5)
    assert chosen()[0] == 7  # a tie keeps the default
    dev(17, 20)
    assert chosen()[0] == 17

    half = [1] * 25 + [0] * 25
    write("baselines_t_4096.jsonl", [rec("full", None, [1] * 50, 16),
                                     rec("snapkv", 512, [0] * 50, 16, kernel=7)])
    write("papers_t_4096.jsonl", [rec(m, 512, half if m == "lava" else [0] * 50, 16, kernel=17)
                                  for m in ("snapkv", "lava")] + [rec("d2o", 512, half, 16)])
    monkeypatch.setattr(s, "qwen_dev_kernel", lambda *a: (17, "", []))
    assert s.qwen_papers("lava") is not None
    got = {(r["a"], r["b"]): r for r in s.REGISTRY}
    # lava vs SnapKV at kernel 17 (the papers sweep's), never the baselines' kernel-7 record
    assert got["lava[kernel=17]", "snapkv[kernel=17]"]["a_wins"] == 25
    assert got["lava[kernel=17]", "full"]["b_wins"] == 25
    assert got["lava[kernel=17]", "full"]["tuned_on"] == "RULER samples 66-115"
    assert set(got) == {("lava[kernel=17]", "full"), ("lava[kernel=17]", "snapkv[kernel=17]")}


def test_qwen_prefill_pages_judge_their_pairs_and_say_where_the_needle_went(monkeypatch,
                                                                            tmp_path):
    """SlimInfer's Qwen block: full from the baselines sweep of the same task (nothing else
    from it), the declared pairs at the paper's schedule, and the needle's survival read
    from `answer_span` against each stage's `kept_blocks` (blocks of 64)."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "sliminfer")

    def rec(method, budget, details, **params):
        return {"method": method, "budget": budget, "scenario": "question_aware",
                "samples": len(details), "accuracy": 0.5, "seed": 0, "task": "ruler/t",
                "context_length": 4096, "ruler_skip": 16, "model": "qwen2.5-coder-0.5b",
                "model_weights": {"sha256": "ab" * 32}, "kv_fraction": 0.3,
                "method_params": {"budget": budget, **params}, "ttft_s": 1.0,
                "ttft_own_s": None, "tpot_s": 0.1, "prefill": "own", "details": details}

    def write(name, recs):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))

    # needle in block 2 (positions 130-137): kept by every stage in 30 prompts, dropped at
    # stage 2 in the other 20; SlimInfer answers the 30
    kept = lambda *stages: {"answer_span": [130, 138], "kept_blocks": list(stages)}  # noqa: E731
    slim = ([{"score": 1.0, **kept([0, 2, 5], [0, 2], [0, 2])}] * 30
            + [{"score": 0.0, **kept([0, 2, 5], [0, 5], [0, 5])}] * 20)
    write("baselines_t_4096.jsonl", [rec("full", None, [{"score": 1.0}] * 50),
                                     rec("snapkv", 512, [{"score": 0.0}] * 50)])
    write("prefill_slim_t_4096.jsonl", [rec("sliminfer", 256, slim, block=64),
                                        rec("lazyllm", 256, [{"score": 0.0}] * 50)])
    text = s.qwen_prefill("sliminfer")
    assert "survived stage 1, 2, 3 in 50, 30, 30 of 50 prompts" in text
    assert "answered 30 of the 30 whose needle every stage kept, 0 of the 20" in text
    got = {(r["a"], r["b"]): r for r in s.REGISTRY}
    assert set(got) == {("sliminfer", "full"), ("lazyllm", "full"), ("sliminfer", "lazyllm")}
    assert got["sliminfer", "lazyllm"]["a_wins"] == 30
    assert "snapkv" not in text  # the baselines sweep gives full only
    assert s.qwen_prefill("asl") is None  # no ASL records yet
    # ASL: whether it selected, and how low its relative variance went (L_min's 1 excluded)
    monkeypatch.setitem(s.PAGE, "name", "asl")
    curve = lambda low: [None] * 8 + [1.0, 2.0, low, 3.0]  # noqa: E731
    asl = [{"score": 0.0, "fallback_snapkv": True, "selection_layer": -1,
            "relative_variance": curve(0.6 + i / 50)} for i in range(50)]
    write("prefill_asl_t_4096.jsonl", [rec("asl", 512, asl, tau=0.3, kernel=7)]
          + [rec(m, 512, [{"score": 0.0}] * 50) for m in ("fastkv", "gemfilter")])
    text = s.qwen_prefill("asl")
    assert "50 of 50 prompts never crossed tau = 0.3" in text
    assert "reached 0.60 at the lowest (median over the prompts of each one's lowest: 1.09)" in text
    assert "ASL's other forms" not in text  # asl_variants not run
    # asl_variants: judged against prefill_asl's GemFilter and ASL on the same samples
    write("asl_variants_t_4096.jsonl",
          [rec("asl_2pass", 512, [{**d, "score": 1.0} for d in asl], tau=0.3, kernel=7),
           rec("asl_full_before", 512, [{**d, "selection_layer": 10, "fallback_snapkv": False}
                                        for d in asl], tau=0.3, kernel=7)])
    s.REGISTRY.clear()
    text = s.qwen_prefill("asl")
    assert "asl_full_before 0 of 50 prompts never crossed tau = 0.3" in text
    assert "layers chosen otherwise (prompts): 10 (50)" in text
    got = {(r["a"], r["b"]): r for r in s.REGISTRY}
    assert got["asl_2pass", "gemfilter"]["a_wins"] == 50
    assert got["asl_full_before", "asl"]["a_wins"] == 0
    assert not any(b.startswith("fastkv[") for _, b in got)  # not run yet: not judged
    # FastKV at ASL's live KV (TSP rate 0.125), added to the file later: judged against ASL
    with open(tmp_path / "asl_variants_t_4096.jsonl", "a") as f:
        f.write(json.dumps(rec("fastkv", 512, [{"score": float(i < 5)} for i in range(50)],
                               tsp_rate=0.125)) + "\n")
    s.REGISTRY.clear()
    text = s.qwen_prefill("asl")
    assert "| fastkv (TSP rate 0.125) | 512 |" in text and "| fastkv | 512 |" in text
    got = {(r["a"], r["b"]): r for r in s.REGISTRY}
    assert (got["asl", "fastkv[tsp_rate=0.125]"]["b_wins"],
            got["asl", "fastkv"]["b_wins"]) == (5, 0)


def test_qwen_asl_reading_is_chosen_on_the_dev_run_by_the_declared_rule(monkeypatch, tmp_path,
                                                                       capsys):
    """ASL's Qwen reading: the defaults where at least half the dev prompts' curves (tau =
    1e-6, L_min's own 1 excluded) fall below tau 0.3 after L_min, else ranks from L_min;
    exit 2 with the reason before the dev run is complete or on other samples."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "asl")
    assert s.main(["--qwen-asl"]) == 2
    assert "dev_asl_default_niah_multikey_2_4096.jsonl is not complete" in capsys.readouterr().err

    def write(lows, skip=66):
        # L_min at layer 2 (its 1 by definition), then the prompt's curve
        d = [{"score": 0.0, "l_obs": 6, "relative_variance": [None, None, 1.0, 0.9, low, 0.8]}
             for low in lows]
        r = {"method": "asl", "samples": len(d), "ruler_skip": skip, "details": d,
             "method_params": {"kernel": 17, "tau": 1e-6}}
        (tmp_path / "dev_asl_default_niah_multikey_2_4096.jsonl").write_text(json.dumps(r) + "\n")
        s.qwen_dev_asl.cache_clear()

    write([0.29] * 25 + [0.31] * 25)
    assert s.main(["--qwen-asl"]) == 0
    assert capsys.readouterr().out == "\n"  # the defaults: no --set
    assert s.qwen_dev_asl()[1] == "25 of 50 dev prompts would select at tau 0.3 under the defaults"
    write([0.29] * 24 + [0.31] * 26)
    assert s.main(["--qwen-asl"]) == 0
    assert capsys.readouterr().out == "--set asl.rank_from=l_min\n"
    # the asl page shows the dev run and its choice before any judged record exists
    text = s.qwen_prefill("asl")
    assert "L_obs 6) with kernel 17" in text and "from L_min (layer 2 of 6)" in text
    assert "24 of 50 dev prompts would select at tau 0.3 under the defaults: chosen " \
           "`rank_from=l_min`." in text
    assert ("| dev, the defaults | 50 | 0.29 / 0.31 | 0 | 24 (layer 4) | 50 (layer 4) | 50 (layer 4) "
            "| 50 (layer 4) |") in text
    assert "![ASL relative rank variance on Qwen2.5-Coder-0.5B](asl_relvar_qwen2.5-coder-0.5b" \
        ".png)" in text and (tmp_path / "docs/results/asl_relvar_qwen2.5-coder-0.5b.png").exists()
    write([0.29] * 50, skip=16)  # the judged samples are never the dev run
    assert s.main(["--qwen-asl"]) == 2


def test_qwen_d2o_shares_and_lava_aggregation_judge_their_declared_pairs(monkeypatch, tmp_path):
    """D2O's own budgets on Qwen: full from the baselines sweep of the same samples, the
    declared pairs at 40% and 20% of the context, labelled by share. LAVa on an aggregation
    task: its own full, partial scores judged paired, only the records at the Qwen kernel.
    CriticalKV context-only: the records' scenario, not full's."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "d2o")

    def rec(method, budget, hits, score=1.0, **params):
        return {"method": method, "budget": budget, "scenario": "question_aware",
                "samples": 50, "accuracy": hits * score / 50, "seed": 0, "task": "ruler/t",
                "context_length": 4096, "ruler_skip": 16, "model": "qwen2.5-coder-0.5b",
                "model_weights": {"sha256": "ab" * 32}, "kv_fraction": 0.3,
                "method_params": {"budget": budget, **params}, "ttft_s": 1.0,
                "ttft_own_s": 0.1, "tpot_s": 0.1, "prefill": "shared",
                "details": [{"score": score * (i < hits)} for i in range(50)]}

    def write(name, recs):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))

    write("baselines_t_4096.jsonl", [rec("full", None, 50), rec("h2o", 512, 3)])
    assert s.qwen_more("d2o") == []
    recs = [rec(m, b, h) for b in (1638, 819) for m, h in (
        ("d2o", 40), ("d2o_code", 30), ("h2o", 20), ("streaming_llm", 10))]
    for r in recs[:2]:  # D2O's layer sizes (Eq. 13) at 40%: plotted
        for d in r["details"]:
            d["layer_sizes"] = [3276, 1212, 1212]
    write("d2o_t_4096.jsonl", recs)
    (text,) = s.qwen_more("d2o")
    png = "d2o_layers_t_4096_qwen2.5-coder-0.5b_d2o.png"
    assert f"]({png})" in text and (tmp_path / "docs/results" / png).exists()
    got = {(r["a"], r["b"], r["budget"]): r for r in s.REGISTRY}
    assert set(got) == {(a, b, share) for a, b in s.QWEN_D2O_PAIRS for share in ("40%", "20%")}
    assert got["d2o", "h2o", "20%"]["a_wins"] == 20  # the same samples, paired
    assert "| h2o | 512 |" not in text  # the baselines sweep gives full only
    s.REGISTRY.clear()  # RoCo and CaM, added to the sweep later: judged once in the file
    write("d2o_t_4096.jsonl", recs + [rec(m, b, 25) for b in (1638, 819) for m in ("roco", "cam")])
    (text,) = s.qwen_more("d2o")
    got = {(r["a"], r["b"], r["budget"]): r for r in s.REGISTRY}
    assert set(got) == {(a, b, share) for a, b in s.QWEN_D2O_PAIRS + s.QWEN_D2O_MERGE_PAIRS
                        for share in ("40%", "20%")}
    assert got["d2o", "cam", "40%"]["a_wins"] == 15 and "| roco | 819 |" in text
    s.REGISTRY.clear()  # D2O's ablations: their own file, D2O re-run beside them
    write("ablation_d2o_t_4096.jsonl", [rec(m, 1638, h) for m, h in (
        ("d2o", 40), ("d2o_uniform_layers", 45), ("d2o_no_merge", 38))])
    _, ablation = s.qwen_more("d2o")
    got = {(r["a"], r["b"], r["budget"]): r for r in s.REGISTRY}
    assert {k for k in got if k[1] in ("d2o_uniform_layers", "d2o_no_merge")} == {
        ("d2o", b, "40%") for _, b in s.QWEN_D2O_ABLATION_PAIRS}
    assert got["d2o", "d2o_uniform_layers", "40%"]["b_wins"] == 5 and "ablations" in ablation
    # LAVa on aggregation: kernel 17 chosen on the dev samples; a kernel-7 record is not read
    monkeypatch.setattr(s, "qwen_dev_kernel", lambda: (17, "", []))
    s.REGISTRY.clear()
    methods = [m for ab in s.QWEN_LAVA_TASK_PAIRS for m in ab]
    write("lava_t_4096.jsonl", [rec("full", None, 50, 0.6)] + [
        rec(m, b, 40 if m == "lava" else 30, 0.5, **({"kernel": 17} if m != "full" else {}))
        for m in dict.fromkeys(methods) if m != "full" for b in (512, 256)]
        + [rec("lava", 512, 0, kernel=7)])
    (text,) = s.qwen_more("lava")
    got = {(r["a"], r["b"], r["budget"]): r for r in s.REGISTRY}
    k17 = lambda m: m if m == "full" else f"{m}[kernel=17]"  # noqa: E731
    assert set(got) == {(k17(a), k17(b), x) for a, b in s.QWEN_LAVA_TASK_PAIRS
                        for x in ("1/8", "1/16")}
    row = got["lava[kernel=17]", "lava_layers_only[kernel=17]", "1/8"]
    assert (row["a_acc"], row["b_acc"], row["a_wins"]) == (0.4, 0.3, 10)
    assert "kernel 7" not in text
    # CriticalKV context-only: its scenario named, its pairs at 1/2 and 2/5
    s.REGISTRY.clear()
    write("critical_co_t_4096.jsonl", [
        {**rec(m, b, h, kernel=17), "scenario": "context_only"} for b in (2048, 1638)
        for m, h in (("snapkv", 10), ("critical_snapkv", 14), ("ada_snapkv", 20),
                     ("critical_adakv", 24))])
    (text,) = s.qwen_more("criticalkv")
    got = {(r["a"], r["b"], r["budget"]): r for r in s.REGISTRY}
    assert set(got) == {(k17(a), k17(b), x) for a, b in s.QWEN_CRITICAL_CO_PAIRS
                        for x in ("1/2", "2/5")}
    assert got["critical_adakv[kernel=17]", "ada_snapkv[kernel=17]", "2/5"]["a_wins"] == 4
    assert "context-only, seed" in text
    # the table shows the file's context-only rows (it once showed full's alone)
    assert "| critical_adakv (kernel 17) | 1638 | 48 [" in text


def test_qwen_baselines_at_a_second_length(monkeypatch, tmp_path):
    """`CTX=8192 sweeps_qwen.sh baselines`: its block beside 4096's, judged at 8192's own
    1/8 and 1/16 with the SnapKV family read at the dev-chosen kernel (records at 7 are not
    judged there); the page names 8192 only once a sweep at it exists."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "baselines")
    monkeypatch.setattr(s, "qwen_dev_kernel", lambda: (17, "", []))
    assert "solves at 4096 (MODEL.md" in s.qwen_baselines()
    recs = [{"method": m, "budget": b, "scenario": "question_aware", "samples": 50,
             "accuracy": 0.5, "seed": 0, "task": "ruler/t", "context_length": 8192,
             "ruler_skip": 16, "model": "qwen2.5-coder-0.5b", "max_new_tokens": 8,
             "model_weights": {"sha256": "ab" * 32}, "kv_fraction": 0.1, "ttft_s": 2.0,
             "ttft_own_s": 0.1, "tpot_s": 0.1, "prefill": "shared", "compile_s": 1.0,
             "method_params": {"kernel": k} if m in s.KERNELED else {},
             "details": [{"score": float(i % 2)} for i in range(50)]}
            for m in ("full", *s.QWEN_METHODS) for b in ((None,) if m == "full" else (1024, 512))
            for k in ((7, 17) if m in s.KERNELED else (None,))]
    (tmp_path / "baselines_t_8192.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = s.qwen_baselines()
    assert "solves at 4096 and 8192 (MODEL.md" in text and "#### ruler/t at 8192\n" in text
    assert "the declared comparisons read the SnapKV family at kernel 17." in text
    assert {(r["context"], r["budget"]) for r in s.REGISTRY} == {(8192, "1/8"), (8192, "1/16")}
    assert {r["a"] for r in s.REGISTRY if r["b"] == "full"} == {
        f"{m}[kernel=17]" if m in s.KERNELED else m for m in s.QWEN_METHODS}


def test_qwen15_key_comparisons(monkeypatch, tmp_path):
    """The 1.5B model's sections: not measured before its `key` sweep, the prefill methods
    outside its plan, then each page's declared pairs at 1/8 judged on the file's records
    (registered under that model, so Holm is over its own comparisons), the kernel methods
    read at the 0.5B's dev kernel and PyramidKV at 7, whose cell against SnapKV's is the
    kernel's paired effect (no claim)."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "lava")
    monkeypatch.setattr(s, "QWEN15", tmp_path)
    s.qwen_dev_kernel.cache_clear()
    monkeypatch.setattr(s, "qwen_dev_kernel", lambda: (17, "dev", []))
    assert s.qwen15("lava").startswith("Not measured yet: the full cache's calibration on")
    (tmp_path / "ruler_4096_n8.jsonl").write_text("")
    assert "calibration is in MODEL.md" in s.qwen15("lava")
    assert s.qwen15("asl").startswith("Not in this model's plan")
    methods = {m for page in ("lava", "baselines") for ab in s.QWEN15_PAIRS[page] for m in ab}

    def rec(m, kernel, scores):
        return {"method": m, "budget": None if m == "full" else 512,
                "scenario": "question_aware", "samples": 50,
                "accuracy": sum(scores) / 50, "seed": 0, "task": "ruler/t",
                "context_length": 4096, "ruler_skip": 16, "model": "qwen2.5-coder-1.5b",
                "max_new_tokens": 8, "model_weights": {"sha256": "cd" * 32},
                "kv_fraction": 0.1, "ttft_s": 2.0, "ttft_own_s": 0.1, "tpot_s": 0.1,
                "prefill": "shared", "method_params": {} if kernel is None else
                {"kernel": kernel}, "details": [{"score": float(x)} for x in scores]}

    half = [i % 2 for i in range(50)]
    recs = [rec(m, 7 if m == "pyramidkv" else 17 if m in s.KERNELED else None,
                [1] * 40 + [0] * 10 if m == "snapkv" else [0] * 45 + [1] * 5
                if m == "pyramidkv" else [1 - x for x in half] if m == "lava" else half)
            for m in sorted(methods)]
    (tmp_path / "key_t_4096.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = s.qwen15("lava")
    assert "#### ruler/t, 1/8" in text and "| h2o |" not in text  # the page's methods only
    assert "at kernel 17 (the 0.5B's dev choice), PyramidKV at its default 7" in text
    got = {(r["a"], r["b"], r["budget"], r["model"]) for r in s.REGISTRY}
    at17 = lambda m: m if m == "full" else f"{m}[kernel=17]"  # noqa: E731
    assert got == {(at17(a), at17(b), "1/8", "qwen2.5-coder-1.5b")
                   for a, b in s.QWEN15_PAIRS["lava"]}
    assert "lava_layers_t_4096_qwen2.5-coder-1.5b_key.png" not in text  # no layer totals
    recs = [{**r, "details": [{**d, "layer_totals": [100 + i for i in range(28)]}
                              for d in r["details"]]} if r["method"] == "lava" else r
            for r in recs]
    (tmp_path / "key_t_4096.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s.REGISTRY.clear()
    assert "](lava_layers_t_4096_qwen2.5-coder-1.5b_key.png)" in s.qwen15("lava")
    assert (tmp_path / "docs" / "results" / "lava_layers_t_4096_qwen2.5-coder-1.5b_key.png"
            ).exists()
    monkeypatch.setitem(s.PAGE, "name", "baselines")
    text = s.qwen15("baselines")
    assert ("SnapKV at kernel 17 80 " in text and "at kernel 7 (PyramidKV's cell" in text
            and "kernel 17 right where 7 is wrong on 40 samples, the reverse on 5" in text)
    assert not any(r["a"].startswith("pyramidkv") and r["b"].startswith("snapkv")
                   for r in s.REGISTRY)


def test_slimmed_batches_keep_what_a_resume_and_the_pages_read(monkeypatch, tmp_path):
    """`--slim` on a sweep's batches file: per-batch layer budgets dropped, each sample's
    [L, K] budgets become per-layer sums, every other field kept, a cut-off line dropped."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "lava")
    piece = {"budget": 4, "ttft": 1.0, "extra": {"layer_budgets": [[[4, 4], [2, 6]]]},
             "samples": [[0, {"score": 1.0, "layer_budgets": [[4, 4], [2, 6]], "x": 1}]]}
    f = tmp_path / "r.jsonl.batches"
    f.write_text(json.dumps({"job": "j", "idx": [0], "piece": piece}) + "\n" + '{"job": "j", "i')
    s.main(["--slim", str(f)])
    (got,) = [json.loads(line) for line in f.read_text().splitlines()]
    assert got["piece"]["extra"] == {}
    assert got["piece"]["samples"] == [[0, {"score": 1.0, "layer_totals": [8, 8], "x": 1}]]
    assert {k: v for k, v in got["piece"].items() if k not in ("extra", "samples")} == \
        {"budget": 4, "ttft": 1.0}


def test_slimmed_records_keep_one_copy_of_each_statistic(monkeypatch, tmp_path):
    """`--slim` on records: a per-batch statistic every sample's details carry goes from
    method_stats (the details keep it), one only some samples carry stays."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "lava")
    rec = {"method": "m", "budget": 4,
           "method_stats": {"kept": [[[1], [2]]], "some": [[1, 2]], "batch": [3]},
           "details": [{"score": 1.0, "kept": [1], "some": 1}, {"score": 0.0, "kept": [2]}]}
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    s.main(["--slim", str(f)])
    (got,) = [json.loads(line) for line in f.read_text().splitlines()]
    assert got["method_stats"] == {"some": [[1, 2]], "batch": [3]}
    assert got["details"] == rec["details"]
    # a benchmark record's predictions go where the details hold the same, else stay
    said = {"line": 1, "id": 0, "dataset": "cwe", "prediction": "a b", "score": 0.5}
    for preds, kept in (([said], False), ([{**said, "prediction": "c"}], True)):
        f.write_text(json.dumps({"method": "m", "budget": 4, "predictions": preds,
                                 "details": [{**said, "depth": 0.5}]}) + "\n")
        s.main(["--slim", str(f)])
        (got,) = [json.loads(line) for line in f.read_text().splitlines()]
        assert ("predictions" in got) == kept
        assert s.report.predictions(got) == preds


def test_perturbation_claims_are_the_records_models(monkeypatch, tmp_path):
    """A perturbation file's claims rows name the model its records ran on (Holm is over a
    paper's comparisons on one model): Qwen's are not SmolLM2's."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "criticalkv")
    recs = [{"model": "qwen2.5-coder-0.5b", "model_weights": {"sha256": "ab" * 32},
             "base": "snapkv", "critical": "critical_snapkv", "budget": 128, "sample": i,
             "samples": 3, "seed": 0, "set": {"kernel": 17}, "task": "niah_single",
             "context": 2048, "window_base": [1.0, 2.0], "window_critical": [1.0, 2.5 + i],
             "question_base": [1.0, 1.0], "question_critical": [0.5, 1.0]} for i in range(3)]
    (tmp_path / "critical_perturb_2048.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in recs))
    assert "critical / base" in s.perturbation(tmp_path)
    assert [(r["model"], r["budget"], r["b_wins"]) for r in s.REGISTRY] == [
        ("qwen2.5-coder-0.5b", "128 (window queries)", 3),
        ("qwen2.5-coder-0.5b", "128 (question queries)", 0)]


def test_perturbation_measures_several_kept_sets_in_one_prefill(monkeypatch, tmp_path):
    """CriticalKV's output perturbation (scripts/criticalkv_results.py): the sets measured
    together give each set's own numbers (one set alone, recomputed), every entry kept gives
    0, and a resumed file skips only the samples of the same sample count (the task spreads
    the needle depths over the count, so sample i of 2 is not sample i of 3)."""
    import json

    import numpy as np

    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import criticalkv_results as ck

    from kvjax import tasks
    from kvjax.api import load

    m = load("tiny-retrieval")
    s = tasks.generate("niah_single", 256, n=1, seed=0)[0]
    ctx, q = m.encode(s.context), m.encode(s.question, bos=False)
    sets = [ck.kept(m, name, 24, ctx, len(q), {"window": 8})
            for name in ("snapkv", "critical_snapkv")]
    every = np.ones_like(sets[0])
    both = ck.perturbation(m, np.stack(sets + [every]), ctx, q, 8)
    assert both.shape == (3, 2, m.cfg.num_layers)
    assert not np.array_equal(sets[0], sets[1]) and (both[:2] > 0).all()
    np.testing.assert_allclose(ck.perturbation(m, sets[1][None], ctx, q, 8)[0], both[1],
                               rtol=1e-5)  # float32 sums of the same terms
    assert np.abs(both[2]).max() <= 1e-3 * both[:2].max()  # the full softmax twice

    f = tmp_path / "p.jsonl"
    args = ["--model", "tiny-retrieval", "--perturb-only", str(f), "--perturb-task",
            "niah_single", "--context", "256", "--pairs", "snapkv", "--perturb-budgets", "24",
            "--set", "window=8"]
    ck.main(args + ["--perturb-samples", "2"])
    ck.main(args + ["--perturb-samples", "2"])  # resumed: nothing to do
    ck.main(args + ["--perturb-samples", "3"])
    recs = [json.loads(line) for line in f.read_text().splitlines()]
    assert [(r["samples"], r["sample"]) for r in recs] == [(2, 0), (2, 1), (3, 0), (3, 1),
                                                           (3, 2)]
    assert len(recs[0]["question_base"]) == m.cfg.num_layers


def test_qwen_sweeps_take_their_budgets_as_shares_of_the_context(tmp_path):
    """scripts/sweeps_qwen.sh with a `python` that records the sweeps it is asked to run (and
    runs the rest: the calibration's solved tasks, the dev choices read from the records):
    each section's budgets are shares of CTX (at 8192 the baselines run 1/8 and 1/16, 1024
    and 512, as the page judges them), batches of 4 there, and asl_variants reads ASL's dev
    choice for both forms; the 1.5B's key sweep its kernels (17 from the 0.5B's dev samples, 7
    for PyramidKV)."""
    import os
    import subprocess

    root = Path(__file__).parent.parent
    log = tmp_path / "runs.txt"
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f"""#!/bin/bash
case "$*" in
  "-m kvjax.run"*|*"--slim"*) echo "$*" >> {log}; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)

    def runs(section, **env):
        log.unlink(missing_ok=True)
        subprocess.run(["bash", "scripts/sweeps_qwen.sh", *section], cwd=root, check=True,
                       env={**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", **env})
        return [line for line in log.read_text().splitlines() if "kvjax.run" in line]

    (line,) = runs(["baselines", "ruler/niah_multikey_2"], CTX="8192")
    assert "--context 8192" in line and "--batch-size 4" in line
    assert "--budget 1024,512 " in line and "baselines_niah_multikey_2_8192.jsonl" in line
    assert ("--set snapkv.kernel=17 --set ada_snapkv.kernel=17 --set pyramidkv.kernel=17 "
            "--set ada_pyramidkv.kernel=17 --output") in line
    (line,) = runs(["baselines", "ruler/niah_multikey_2"])  # 4096: as it ran, kernel 7
    assert "--set" not in line
    (line,) = runs(["critical_co", "ruler/niah_multikey_2"])
    assert "--budget 2048,1638 " in line and "--context 4096" in line
    (line,) = runs(["asl_variants", "ruler/niah_multikey_2"])
    assert ("--method asl_2pass,asl_full_before,fastkv --set kernel=17 --set "
            "asl_2pass.rank_from=l_min --set asl_full_before.rank_from=l_min --set "
            "fastkv.tsp_rate=0.125") in line
    assert "--budget 512 " in line
    runs(["prefill", "ruler/niah_multikey_2"])  # LazyLLM's per-token kept sets slimmed
    assert ("--every-method --slim docs/results/qwen2.5-coder-0.5b/prefill_slim_"
            in log.read_text())
    (line,) = runs(["key", "ruler/niah_multikey_2"], MODEL="qwen2.5-coder-1.5b")
    assert "--model qwen2.5-coder-1.5b" in line and "--budget 512 " in line
    assert ("--set snapkv.kernel=17 --set ada_snapkv.kernel=17 --set lava.kernel=17 "
            "--set critical_snapkv.kernel=17 --set pyramidkv.kernel=7") in line


def test_perplexity_under_way_shows_its_runs_and_judges_once_both_arms_exist(monkeypatch,
                                                                           tmp_path):
    """A perplexity file part-way (`sweeps_qwen.sh perplexity` resumes a run at a time): its
    runs tabled, no claims table while no declared pair has both arms; then D2O vs H2O
    judged over the paired blocks, under the records' model."""
    import json

    s = _qwen_renderer(monkeypatch, tmp_path, "d2o")

    def rec(label, rho, nll):
        return {"model": "qwen2.5-coder-0.5b", "text": "genesis", "tokens": 2048, "prompt": 512,
                "label": label, "rho": rho, "span": "512-2048", "ppl": 1.0, "wall_s": 60.0,
                "nll_blocks": [nll + 0.01 * i for i in range(12)], "method_params": {}}

    f = tmp_path / "d2o_ppl_genesis.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in
                         (rec("full", 1.0, 2.0), rec("h2o", 0.2, 2.5))))
    text = s.d2o_perplexity(tmp_path)
    assert "| h2o | 12." in text and "No declared comparison" in text and not s.REGISTRY
    with f.open("a") as out:
        out.write(json.dumps(rec("d2o", 0.2, 2.4)) + "\n")
    text = s.d2o_perplexity(tmp_path)
    (row,) = s.REGISTRY
    assert (row["a"], row["b"], row["model"], row["a_wins"]) == (
        "d2o", "h2o", "qwen2.5-coder-0.5b", 12)
    assert "@@claims-table-" in text


def test_d2o_layer_sizes_diagnostic(monkeypatch):
    """`d2o_results.py --layer-sizes`' reader on the bundled model: D2O's S_l after the
    prompt sum to budget x L (Eq. 13's water-fill) within [T + 2, 2 x budget]; d2o_code,
    which sizes its layers at the first step, gives its kept fractions; H2O neither; the
    perplexity run records D2O's beside its NLL."""
    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import d2o_results as d

    from kvjax import api, methods
    from kvjax.tasks.prose import text_ids

    model = api.load("tiny-retrieval")
    ids = text_ids("haystack", model.encode, 160)
    got = d.layer_sizes(model, methods.create("d2o").with_budget(32), ids, 128)
    sizes = got["layer_sizes"]
    assert len(sizes) == model.cfg.num_layers and sum(sizes) == 32 * model.cfg.num_layers
    assert all(4 + 2 <= s <= 64 for s in sizes)
    ratios = d.layer_sizes(model, methods.create("d2o_code").with_budget(32), ids, 128)
    assert len(ratios["layer_ratios"]) == model.cfg.num_layers
    assert d.layer_sizes(model, methods.create("h2o").with_budget(32), ids, 128) == {}
    # the perplexity run records the same sizes beside its NLL (one per fed token)
    nll, layers = d.token_nll(model, methods.create("d2o").with_budget(32), ids[:136], 128)
    assert nll.shape == (8,) and layers == got
