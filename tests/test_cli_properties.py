"""A property over the CLI's argument space, on a tiny random model: every run either writes
valid records (exit 0) or exits 2 with one `error:` line -- never a traceback, never an
internal error, never another exit status (docs/reliability.md).

The fast test draws a few fixed examples (derandomized, so CI sees the same ones); the
slow one draws many more at random."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvjax import report
from kvjax.cli import main as cli
from kvjax.cli import args as run_args, sweep as run_sweep

from test_cli_api import model_dir  # noqa: F401 -- the tiny checkpoint fixture

# each option: (values a run takes, values it must refuse or that fail its checks)
OPTIONS = {
    "--method": (["full", "snapkv", "streaming_llm", "pyramidkv", "h2o", "tova",
                  "critical_snapkv"], ["nope", ""]),
    "--task": (["passkey", "niah_single", "frequent_words"], ["kv_retrieval", "nope"]),
    "--context": (["96", "128"], ["16", "0", "-5", "5000", "x"]),
    "--budget": (["40", "48", "64"], ["0", "-3", "24", "1000", "4.5", "abc"]),
    "--ratio": (["0", "0.25", "0.5"], ["0.9", "1", "-0.1", "nan", "x"]),
    "--samples": (["1"], ["0", "-1"]),
    "--seed": (["0", "3"], ["-1"]),
    "--max-new-tokens": (["0", "1", "2"], ["-1"]),
    "--batch-size": (["1", "2"], ["0"]),
    "--scenario": (["question_aware", "context_only"], ["both"]),
    "--kernels": (["xla", "auto"], ["cuda"]),
    "--set": (["alpha=0.5"], ["window=abc", "window=null", "window=2.5", "window=true",
                             "window=8", "budget=40", "beta=2", "x", "=3"]),
}
LISTS = ("--method", "--task", "--context", "--budget", "--ratio")
OUTPUTS = (["none", "new.json", "new.jsonl", "exists --overwrite"],
           ["exists", "exists --resume", "missing/r.json", "dir"])


@st.composite
def argvs(draw):
    """(arguments, output spec). Half the cases draw only values a run takes (so the
    property is seen on runs that write records too), half from everything."""
    clean = draw(st.sampled_from([True, False]))

    def value(opt):
        ok, bad = OPTIONS[opt]
        return draw(st.sampled_from(ok if clean else ok + bad))

    def items(opt):
        n = draw(st.integers(1, 2 if opt == "--method" or not clean else 1))
        xs = [value(opt) for _ in range(n)]
        if clean:
            xs = list(dict.fromkeys(xs))
        return draw(st.sampled_from([",", ", "] if clean else [",", ", ", ",,"])).join(xs)

    argv = []
    for opt in ("--method", "--task", "--context", "--samples", "--max-new-tokens"):
        argv += [opt, items(opt) if opt in LISTS else value(opt)]
    which = draw(st.sampled_from(["--budget", "--ratio", None]))
    if which:
        argv += [which, items(which)]
    for opt in ("--seed", "--batch-size", "--scenario", "--kernels", "--set"):
        if draw(st.integers(0, 2)) == 0 and not (clean and opt == "--set"):
            argv += [opt, value(opt)]
    if draw(st.booleans()):
        argv.append("--details")
    out = OUTPUTS[0] if clean else OUTPUTS[0] + OUTPUTS[1]
    return argv, draw(st.sampled_from(out))


def _expected_records(argv: list[str]) -> int:
    """Records a successful run of a fresh output holds: the product, a method without a
    budget once per task and context."""
    a = run_args.parse_args(argv)
    points = len(a.budget or a.ratio or [None])
    extra = run_args.split_pairs(a.set)
    n = 0
    for name in a.method:
        m = run_sweep.configured(name, extra, a)
        n += points if m.takes_budget() else 1
    return n * len(a.task) * len(a.context)


def check_one(model: Path, argv: list[str], output: str) -> int:
    """Run the CLI in process on one drawn case and check the property; the exit status."""
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        name, *flags = output.split()
        path = d / ("exists.json" if name == "exists" else name)
        if name == "exists":
            path.write_text("not records")
        (d / "dir").mkdir()
        out = [] if name == "none" else ["--output", str(path), *flags]
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            # an exception here is the traceback the user would see
            rc = cli.main(["--model", str(model), *argv, *out, "--no-progress"])
        text = err.getvalue()
        errors = [x for x in text.splitlines() if x.startswith("error:")]
        assert "Traceback" not in text, text
        if rc == 2:
            assert len(errors) == 1 and text.splitlines()[-1] == errors[0], text
            assert "internal error" not in errors[0], errors[0]
            return rc
        assert rc == 0 and not errors, (rc, text)
        if name in ("none", "dir", "missing/r.json") or flags == ["--resume"]:
            return rc
        recs = report.load_records(path)
        assert len(recs) == _expected_records(argv)
        samples = run_args.parse_args(argv).samples
        for r in recs:
            assert r["samples"] == samples and 0 <= r["accuracy"] <= 1
            assert r["kv_bytes_live"] <= r["kv_bytes_full"]
            assert set(r["job"]) >= {"method", "budget", "ratio", "task", "context"}
            json.dumps(r, allow_nan=False)
        if path.suffix == ".json":
            assert report.is_complete(path)
        return rc


def test_cli_either_records_or_one_error_line(model_dir):  # noqa: F811
    """Ten fixed examples; they include runs that write records and runs that are
    refused (a property that only ever saw refusals would hold vacuously)."""
    seen = []

    @settings(max_examples=10, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=argvs())
    def prop(case):
        seen.append(check_one(model_dir, *case))

    prop()
    assert 0 in seen and 2 in seen, seen


@pytest.mark.slow
def test_cli_either_records_or_one_error_line_many(model_dir):  # noqa: F811
    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=argvs())
    def prop(case):
        check_one(model_dir, *case)

    prop()
