"""Every notebook's code cells run top to bottom (shell/magic lines skipped)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvjax.api import BUNDLED_DIR

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.skipif(not (BUNDLED_DIR / "tiny-retrieval" / "config.json").exists(),
                    reason="the notebooks use the bundled model, not built in this checkout")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(path.parent)
    ns: dict = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            src = "".join(line for line in cell["source"] if not line.lstrip().startswith(("!", "%")))
            exec(compile(src, f"{path.name}", "exec"), ns)
