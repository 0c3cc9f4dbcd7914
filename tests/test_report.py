"""kvjax.report arranges records into tables; it must never hide one."""

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
