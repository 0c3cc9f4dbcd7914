"""scripts/results_overview.py: docs/results/README.md from the pages' records."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "docs" / "results"


@pytest.fixture(scope="module")
def ov():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return runpy.run_path(str(ROOT / "scripts" / "results_overview.py"))
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def _record(method, budget, task, acc, **kw):
    return {"method": method, "budget": budget, "task": task, "accuracy": acc,
            "context_length": kw.pop("context", 512), "scenario": kw.pop("scenario",
                                                                         "question_aware"),
            "samples": kw.pop("samples", 8), "seed": 0, "kv_fraction": kw.pop("kv", 0.25),
            "method_params": kw.pop("params", {}), "model": "tiny-retrieval",
            "model_weights": {"sha256": "ab" * 32, "trained_steps": 6700}, **kw}


def _write(folder: Path, name: str, records: list[dict], title: str | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"records": records}))


def test_overview_keeps_measurements_apart(ov, tmp_path):
    res = tmp_path / "results"
    (res / "base.md").parent.mkdir(parents=True)
    (res / "base.md").write_text("# Base page\n")
    (res / "other.md").write_text("# Other page\n")
    (res / "speed.md").write_text("# Timings\n")
    _write(res, "base_question_aware", [
        _record("full", None, "passkey", 1.0, kv=1.0),
        _record("snapkv", 64, "passkey", 0.75, kv=0.125),
        _record("snapkv", 128, "passkey", 1.0, kv=0.25),
        _record("snapkv", 64, "frequent_words", 0.4, kv=0.125),
        _record("snapkv", 64, "passkey", 0.5, kv=0.125, scenario="context_only"),
        _record("snapkv", 64, "passkey", 0.25, kv=0.125, context=2048)])
    _write(res, "other_x", [
        _record("snapkv", 128, "passkey", 1.0, kv=0.25),           # the same: shown once
        _record("snapkv", 64, "passkey", 0.5, kv=0.125, seed=1),   # measured differently
        _record("asl", 64, "passkey", 0.5, params={"l_obs": 3}),
        _record("asl", 128, "passkey", 0.5, params={"l_obs": 3})])
    _write(res, "base_y", [_record("asl", 64, "passkey", 0.0, params={"l_obs": 8})])
    out = tmp_path / "out"
    text = ov["overview"](res, out)
    assert text == (out / "README.md").read_text()
    # one section per scenario and context, one plot each
    for head, png in [("question-aware, context 512", "overview_question_aware_512.png"),
                      ("context-only, context 512", "overview_context_only_512.png"),
                      ("question-aware, context 2048", "overview_question_aware_2048.png")]:
        assert f"## {head}" in text
        if ov["report"].pyplot() is not None:
            assert (out / png).exists() and f"]({png})" in text
    # Wilson intervals on a binary task, none on a non-binary one
    assert ("| snapkv |  | 75 [41, 93] / 50 [22, 78] | 100 [68, 100] | [base](base.md), "
            "[other](other.md) |") in text
    assert "| snapkv | 40 | [base](base.md) |" in text
    assert "mean score % (not 0/1 per sample: no interval)" in text
    # variants named by what differs; a cell measured twice differently shows both + a note
    assert "| asl (l_obs=8) |" in text and "| asl (l_obs=3) |" in text
    assert "measured differently in `base_question_aware.json`, `other_x.json`" in text
    # every page linked, pages without accuracy records said so
    assert "| [speed](speed.md) | Timings | none (timings, memory or kernels) |" in text
    assert "model tiny-retrieval at trained step 6700, weights sha256 abababababab" in text


def test_docs_results_overview_is_current(ov, tmp_path):
    """docs/results/README.md is what the script writes from the records beside it: re-run
    `python scripts/results_overview.py` after changing a page's records."""
    text = ov["overview"](RESULTS, tmp_path)
    assert (RESULTS / "README.md").read_text() == text
    for png in tmp_path.glob("*.png"):
        assert (RESULTS / png.name).exists(), png.name


def test_docs_results_stays_small():
    # 5 MB held the SmolLM2 and tiny-model pages; the claims registry (0.2 MB) and the
    # real models' RULER records (per-sample predictions, ~1.5 MB) needed 8; each Qwen task
    # adds ~1.5 MB of slimmed records (baselines, dev pooling, papers: 11 methods x 2
    # budgets x 50 samples, `smollm2_results.py --slim`), two tasks and their sweeps under
    # way: 11 MB; D2O's own budgets on Qwen (0.6 MB) and CriticalKV's perturbation at 32
    # samples (0.75 MB over both models): 12 MB. Each per-sample statistic stored once
    # (`method_stats` no longer repeats the details: 1.5 MB, SlimInfer's kept blocks most)
    # left 10.5 MB; LAVa on cwe (1.1 MB: 120-token answers) made 12.06, and each benchmark
    # prediction stored once (the details hold them, `report.predictions`) 11.2 MB. The
    # SmolLM2 comparisons the pages declared without records (2026-11-29: LAVa's ablations
    # on every task, the baselines at 1024 and 4096, D2O's family at 1024; 0.7 MB of
    # records, 60 claims) and RULER's vt on Qwen under way (its unmerged batches, 0.55 MB,
    # shrink to ~0.15 when slimmed) made 12.6: 14 MB. vt's papers sweep and its own dev
    # pooling sweep (0.4 MB, the papers records slimmed of LAVa's layer weights and D2O's
    # thresholds: -0.16 MB) made 14.1, and the papers' methods at 8192 (~0.4 MB) are under
    # way: 15 MB. Next to slim: tiny/ (2.1 MB, the appendix model), then claims.jsonl's
    # record keys (0.6 MB; each repeats its row's task, context, seed and scenario)
    size = sum(f.stat().st_size for f in RESULTS.rglob("*") if f.is_file())
    assert size < 15_000_000, f"docs/results is {size / 1e6:.2f} MB: keep it under 15 MB"


def test_readme_claims_table_is_current(ov):
    """The README's claims table is the one the script writes from claims.jsonl."""
    text = (ROOT / "README.md").read_text()
    body = text.split("<!-- claims -->\n", 1)[1].split("\n<!-- /claims -->", 1)[0]
    assert body == ov["readme_claims"](RESULTS)


def test_quoted_figures_come_from_their_files():
    """The figures the README and MODEL.md quote, read again from the file each comes from:
    the sweep's cost ratios (the benchmark's output in speed.md) and the full cache's
    niah_single at 4096 on the baselines' 50 samples (its records)."""
    import re

    from kvjax import report

    readme = " ".join((ROOT / "README.md").read_text().split())
    first, separate = re.search(r"5 methods cost ([\d.]+)x one method's sweep, ([\d.]+)x the "
                                r"same grid method by method", readme).groups()
    speed = (RESULTS / "speed.md").read_text()
    bench = re.findall(r"shared / first ([\d.]+)x .*shared / separate ([\d.]+)x", speed)
    assert bench and bench[-1] == (first, separate), (bench, first, separate)

    full = [r for r in report.load_records(RESULTS / "smollm2" / "baselines_4096.jsonl")
            if r["method"] == "full"]
    lo, hi = report.wilson(full[0]["accuracy"] * full[0]["samples"], full[0]["samples"])
    quoted = (f"{100 * full[0]['accuracy']:.0f} [{100 * lo:.0f}, {100 * hi:.0f}]")
    model = " ".join((ROOT / "MODEL.md").read_text().split())
    assert f"50-sample draw, docs/results/baselines.md, finds niah_single at {quoted}" in model
