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
