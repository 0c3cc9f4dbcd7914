"""The paired statistics of `kvjax.claims` and the claims registry (docs/results/claims.jsonl)
against the records it names."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from kvjax import claims

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "docs" / "results" / "claims.jsonl"


@pytest.mark.parametrize("a_wins,b_wins", [(0, 0), (10, 1), (10, 0), (8, 0), (11, 0), (3, 15),
                                           (7, 7), (0, 50), (123, 100)])
def test_mcnemar_is_the_exact_binomial_test_on_the_discordant_pairs(a_wins, b_wins):
    want = 1.0 if a_wins + b_wins == 0 else stats.binomtest(a_wins, a_wins + b_wins).pvalue
    assert claims.mcnemar(a_wins, b_wins) == pytest.approx(want, rel=1e-12)


def test_the_issues_five_comparisons_have_their_paired_p():
    # LAVa vs Ada-SnapKV 10:1, Ada vs SnapKV 10:0, critical vs SnapKV 8:0, LazyLLM vs
    # SlimInfer 10:1, StreamingLLM vs H2O 11:0: p 0.012, 0.002, 0.008, 0.012, 0.001
    for (a, b), p in zip([(10, 1), (10, 0), (8, 0), (10, 1), (11, 0)],
                         [0.012, 0.002, 0.008, 0.012, 0.001]):
        assert round(claims.mcnemar(a, b), 3) == p


def test_holm_steps_down_and_stays_monotone():
    assert claims.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert claims.holm([0.2, 0.9]) == pytest.approx([0.4, 0.9])
    assert claims.holm([0.6, 0.6]) == [1.0, 1.0]


def test_newcombe_interval_contains_the_difference_and_mirrors():
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = list(rng.integers(0, 2, 50).astype(float))
        b = list(rng.integers(0, 2, 50).astype(float))
        lo, hi = claims.newcombe(a, b)
        d = (sum(a) - sum(b)) / 50
        assert -1 <= lo <= d <= hi <= 1
        lo2, hi2 = claims.newcombe(b, a)
        assert (lo2, hi2) == pytest.approx((-hi, -lo))


def test_newcombe_matches_a_published_example():
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables" (2017),
    # Ch. 8, Cavo et al. (2012): the paired table [[59, 6], [16, 80]]; the Newcombe
    # square-and-add interval is -0.0621 (95% CI -0.1186 to -0.0046).
    a = [1] * 59 + [1] * 6 + [0] * 16 + [0] * 80
    b = [1] * 59 + [0] * 6 + [1] * 16 + [0] * 80
    lo, hi = claims.newcombe(a, b)
    assert (round(lo, 4), round(hi, 4)) == (-0.1186, -0.0046)


def test_sign_flip_is_exact_for_few_differences():
    a, b = [1, 1, 1, 0.5, 0], [0, 0, 0, 0, 0]
    # nonzero differences 1, 1, 1, 0.5: of 16 sign patterns those with |sum| >= 3.5 are 2
    assert claims.sign_flip(a, b) == pytest.approx(2 / 16)
    assert claims.sign_flip([0.3, 0.7], [0.3, 0.7]) == 1.0


def test_verdict_rules():
    def s(a_acc, b_acc, a_wins=0, b_wins=0, lo=0.0, hi=0.0):
        return {"a_acc": a_acc, "b_acc": b_acc, "a_wins": a_wins, "b_wins": b_wins,
                "diff_lo": lo, "diff_hi": hi}

    assert claims.verdict("better", s(0.04, 0.1), 0.001)[0] == "uninformative"
    assert claims.verdict("better", s(0.96, 1.0), 0.001)[0] == "uninformative"
    assert claims.verdict("better", s(0.78, 0.58, 10, 0), 0.025) == ("holds", "a wins")
    assert claims.verdict("better", s(0.1, 0.4, 0, 16), 0.001) == ("does not hold", "b wins")
    assert claims.verdict("better", s(0.96, 0.78, 10, 1), 0.35)[0] == "cannot tell"
    # "no worse": both at the ceiling still informs; the margin decides
    assert claims.verdict("no worse", s(0.98, 1.0, lo=-0.04, hi=0.02), 1)[0] == "holds"
    assert claims.verdict("no worse", s(0.86, 0.94, lo=-0.2, hi=0.02), 1)[0] == "cannot tell"
    assert claims.verdict("no worse", s(0.18, 1.0, lo=-0.9, hi=-0.7), 0)[0] == "does not hold"
    with pytest.raises(ValueError, match="claim kind 'worse'"):
        claims.verdict("worse", s(0.5, 0.5), 1)


def test_paired_scores_refuse_other_prompts():
    ra = {"method": "a", "details": [{"answer": ["1"], "depth": 0.1, "score": 1.0}]}
    rb = {"method": "b", "details": [{"answer": ["2"], "depth": 0.1, "score": 0.0}]}
    with pytest.raises(ValueError, match="not the same prompts"):
        claims.paired_scores(ra, rb)


def _registry() -> list[dict]:
    return [json.loads(x) for x in REGISTRY.read_text().splitlines() if x.strip()]


def test_registry_recomputes_from_the_records_it_names():
    """Every row's statistics, Holm-adjusted p and verdict, recomputed from its records."""
    rows = _registry()
    assert rows, "docs/results/claims.jsonl is empty"
    fresh = []
    for r in rows:
        got = claims.recompute(r, ROOT)
        for k in ("n", "a_wins", "b_wins"):
            assert got[k] == r[k], (r["id"], k)
        for k in ("a_acc", "b_acc", "p", "diff_lo", "diff_hi"):
            assert math.isclose(got[k], r[k], rel_tol=1e-9, abs_tol=1e-12), (r["id"], k)
        fresh.append({**{k: r[k] for k in ("paper", "model", "kind", "margin", "metric")}, **got,
                      "margin": r["margin"] or claims.MARGIN})
    for r, j in zip(rows, claims.judge(fresh)):
        assert math.isclose(j["p_holm"], r["p_holm"], rel_tol=1e-9), r["id"]
        assert (j["verdict"], j["reason"]) == (r["verdict"], r["reason"]), r["id"]


def test_registry_holds_the_issues_five_comparisons():
    rows = _registry()

    def find(a, b, task, ctx, budget):
        hit = [r for r in rows if r["a"] == a and r["b"] == b and r["task"] == task
               and r["context"] == ctx and r["budget"] == budget
               and r["scenario"] == "question_aware" and r["n"] == 50]
        assert len(hit) == 1, (a, b, ctx, budget)
        return hit[0]

    k17 = "[kernel=17]"
    cases = [find("lava" + k17, "ada_snapkv" + k17, "niah_single", 1024, "1/8"),
             find("ada_snapkv" + k17, "snapkv" + k17, "niah_single", 1024, "1/8"),
             find("critical_snapkv" + k17, "snapkv" + k17, "niah_single", 2048, "1/16"),
             next(r for r in rows if r["a"].startswith("sliminfer") and
                  r["b"].startswith("lazyllm") and r["context"] == 2048),
             next(r for r in rows if (r["a"], r["b"]) == ("h2o", "streaming_llm")
                  and r["budget"].startswith("40%"))]
    assert [(r["a_wins"], r["b_wins"]) for r in cases] == [(10, 1), (10, 0), (8, 0), (1, 10),
                                                           (0, 11)]
    assert all(r["verdict"] in claims.VERDICTS for r in cases)


def test_pages_show_the_registrys_verdicts():
    """Each row's page (or MODEL.md's calibration, for the rows it reads) carries the row's
    verdict on the table line that names the row's id; hand-written text that cites the id
    names the same verdict near it (in its sentence before the id, at most 300 characters
    back, or within 40 characters after)."""
    text = {p: (ROOT / p).read_text() for p in {r["page"] for r in _registry()} | {"MODEL.md"}}
    for r in _registry():
        tag = re.compile(rf"#{r['id']}\b")
        hits = [x for p in (r["page"], "MODEL.md") for x in text[p].splitlines()
                if tag.search(x) and x.startswith("|")]
        assert hits, (r["id"], r["page"], r["a"], r["b"], r["budget"])
        assert all(f"| {r['verdict']} |" in x for x in hits), (r["id"], hits)
        for p in (r["page"], "MODEL.md"):
            for m in tag.finditer(text[p]):
                line = text[p][text[p].rfind("\n", 0, m.start()) + 1:m.start()]
                if not line.startswith("|"):
                    before = text[p][:m.start()]  # from the sentence's start at most
                    start = max(before.rfind(". "), before.rfind("\n- "), m.start() - 300)
                    near = text[p][max(0, start):m.end() + 40]
                    assert r["verdict"] in near.replace("\n  ", " "), (r["id"], near)


def test_unbounded_metrics_have_no_floor():
    """Minus a perplexity's NLL is never "on the floor": only accuracies have one."""
    s = {"a_acc": -2.8, "b_acc": -1.9, "a_wins": 0, "b_wins": 12, "diff_lo": -1, "diff_hi": -0.7}
    assert claims.verdict("better", s, 0.017, bounded=False) == ("does not hold", "b wins")
    assert claims.verdict("better", s, 0.017)[0] == "uninformative"  # read as accuracies
    recs = [{"nll_blocks": [2.0, 3.0]}, {"question_base": [1.0, 2.0]}]
    assert claims.units(recs[:1], "nll") == [-2.0, -3.0]
    assert claims.units(recs[1:], "perturbation", "question_base") == [-3.0]
