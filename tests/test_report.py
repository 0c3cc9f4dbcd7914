"""kvjax.report arranges records into tables; it must never hide one."""

import json

import pytest

from kvjax import report


def _rec(method, task, acc, budget=64):
    return {"method": method, "task": task, "accuracy": acc, "budget": budget}


def test_table_holds_every_record_once():
    recs = [_rec("snapkv", "passkey", 0.5), _rec("snapkv", "niah_single", 0.25),
            _rec("full", "passkey", 1.0)]
    md = report.markdown_table(recs, lambda r: r["method"], lambda r: r["task"],
                               lambda r: 100 * r["accuracy"], fmt="{:.0f}", mean_col=True)
    assert md.splitlines()[2:] == ["| snapkv | 50 | 25 | 38 |", "| full | 100 | - | 100 |"]


def test_two_records_in_one_cell_are_refused():
    # two budgets of one method under a row key without the budget: the table would show
    # whichever record came last
    recs = [_rec("snapkv", "passkey", 0.5, 64), _rec("snapkv", "passkey", 0.9, 128)]
    with pytest.raises(ValueError, match="two records for row 'snapkv', column 'passkey'"):
        report.markdown_table(recs, lambda r: r["method"], lambda r: r["task"],
                              lambda r: r["accuracy"])


def _weighed(sha, steps=4100):
    return {**_rec("full", "passkey", 1.0), "model": "tiny-retrieval",
            "model_weights": {"sha256": sha, "trained_steps": steps}}


def test_model_line_names_the_weights_and_refuses_a_mixture():
    assert report.model_line([_weighed("ab" * 32)] * 2) == (
        "model tiny-retrieval at trained step 4100, weights sha256 abababababab")
    assert "not recorded" in report.model_line([{**_rec("full", "passkey", 1.0), "model": "m"}])
    with pytest.raises(ValueError, match="records of 2 different models or weights"):
        report.model_line([_weighed("ab" * 32), _weighed("cd" * 32, 5700)])


def test_run_once_never_reuses_records_of_other_weights(tmp_path):
    from kvjax.api import model_dir
    from kvjax.models.checkpoint import weights_sha256

    old = tmp_path / "r.json"
    old.write_text(json.dumps({"records": [_weighed("ab" * 32)]}))
    with pytest.raises(ValueError, match="not of the model's current weights"):
        report.run_once(old, ["--model", "tiny-retrieval"], tmp_path)
    now = weights_sha256(model_dir("tiny-retrieval"))
    old.write_text(json.dumps({"records": [_weighed(now)]}))
    assert report.run_once(old, ["--model", "tiny-retrieval"], tmp_path) == old  # reused


def test_load_records_reads_json_and_json_lines(tmp_path):
    recs = [_rec("snapkv", "passkey", 0.5), _rec("full", "passkey", 1.0)]
    old = tmp_path / "old.json"  # as every file under docs/results
    old.write_text(json.dumps({"records": recs, "wall_s": 3.0, "args": {}}))
    lines = tmp_path / "new.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in recs))
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(recs[0]) + "\n")
    assert report.load_records(old) == recs == report.load_records(lines)
    assert report.load_records(one, old) == [recs[0], *recs]
    lines.write_text(json.dumps(recs[0]) + "\n{\"method\": \"sna\n")
    with pytest.raises(ValueError, match=r"new\.jsonl:2: not a JSON line"):
        report.load_records(lines)


def test_results_json_files_still_load():
    from pathlib import Path

    files = sorted((Path(__file__).parent.parent / "docs" / "results").rglob("*.json"))
    assert files
    for f in files:
        assert report.load_records(f), f


def test_run_once_resumes_an_incomplete_output(tmp_path, monkeypatch):
    """An interrupted sweep keeps its finished records (`"complete": false`): the results
    scripts resume it instead of taking it for finished."""
    import subprocess

    from kvjax.api import model_dir
    from kvjax.models.checkpoint import weights_sha256

    now = weights_sha256(model_dir("tiny-retrieval"))
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: calls.append(cmd))
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"records": [_weighed(now)], "complete": False}))
    report.run_once(out, ["--model", "tiny-retrieval"], tmp_path)
    assert calls[-1][-3:] == ["--output", str(out), "--resume"]
    out.write_text(json.dumps({"records": [_weighed(now)], "complete": True}))
    report.run_once(out, ["--model", "tiny-retrieval"], tmp_path)
    assert len(calls) == 1  # complete: not run again
    report.run_once(tmp_path / "new.json", ["--model", "tiny-retrieval"], tmp_path)
    assert calls[-1][-2:] == ["--output", str(tmp_path / "new.json")]


def test_wilson_interval():
    # textbook values (Wilson 1927; e.g. Newcombe 1998, Table I): 0/10 -> [0, 0.278],
    # 10/10 -> [0.722, 1], 5/10 -> [0.237, 0.763]
    assert report.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert report.wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert report.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    with pytest.raises(ValueError, match="n must be positive"):
        report.wilson(0, 0)


def test_write_page_keeps_the_real_models_sections(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Old\n\n## On SmolLM2\n\n<!-- smollm2-x -->\nkept\n<!-- /smollm2-x -->\n\n"
                    "## On Qwen\n\n<!-- qwen-x -->\nqkept\n<!-- /qwen-x -->\n\n"
                    "## On tiny-retrieval (earlier; not a language model)\nold body\n")
    report.write_page(page, "# New\nnew body\n")
    text = page.read_text()
    assert text.startswith("# New\n\n## On SmolLM2\n\n<!-- smollm2-x -->\nkept\n")
    assert "## On Qwen\n\n<!-- qwen-x -->\nqkept\n<!-- /qwen-x -->" in text
    assert "new body" in text and "old body" not in text
    report.write_page(tmp_path / "q.md", "# Fresh\nbody\n")
    assert (tmp_path / "q.md").read_text() == "# Fresh\nbody\n"
