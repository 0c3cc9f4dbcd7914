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
