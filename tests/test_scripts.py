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
