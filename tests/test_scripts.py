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
    assert abs(s._sweep_minutes(recs) - want / 60) < 1e-9
