"""The record's typed schema (`kvjax.cli.schema`): it names every field the records in
docs/results hold, and writes what they hold."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvjax import report
from kvjax.cli.schema import Record, Weights

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _runs() -> list[dict]:
    """The records `python -m kvjax.run` wrote since records carry their `job` (the
    perplexity and GPU records under docs/results are other scripts' own)."""
    files = sorted(RESULTS.glob("*/*.jsonl"))
    return [r for f in files for r in report.load_records(f) if "job" in r]


def test_every_field_of_the_records_on_disk_is_in_the_schema():
    fields = {f.name for f in dataclasses.fields(Record)}
    runs = _runs()
    assert len(runs) > 100
    seen = set().union(*runs)
    assert seen - fields == set()
    required = {f.name for f in dataclasses.fields(Record)
                if f.default is dataclasses.MISSING}
    # records written since the shared prefill (its `prefill` field) hold every one; older
    # ones lack the fields added since (prefill, ttft_own_s, machine)
    recent = [r for r in runs if "prefill" in r]
    assert len(recent) > 100 and all(required <= set(r) for r in recent)


def test_as_json_leaves_out_what_was_not_measured_and_keeps_the_order():
    for one in (_runs()[0], next(r for r in _runs() if "benchmark" in r)):
        kw = {k: v for k, v in one.items() if k != "model_weights"}
        rec = Record(**kw, model_weights=Weights.of(one))
        assert rec.as_json() == one and list(rec.as_json()) == list(one)
    skipped = dataclasses.replace(rec, ruler_skip=8).as_json()
    assert list(skipped)[list(skipped).index("seed") + 1] == "ruler_skip"


def test_weights_of_a_record_older_than_the_field():
    assert Weights.of({"method": "full"}) == Weights(None, None)
    assert report.record_weights({"model_weights": {"sha256": "ab", "trained_steps": 3}}) == \
        ("ab", 3)
