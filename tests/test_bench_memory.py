"""`python -m kvjax.bench.memory` (docs/results/memory.md): one configuration measured in
process at a small context."""

from kvjax.bench import memory


def test_child_measures_the_run_not_the_compilation():
    a = memory.parse(["--context", "1024", "--budget", "128", "--layers", "2"])
    a.child = "snapkv"
    r = memory.child(a)
    # the warm-up compiled the very program engine.run calls: nothing compiles while the
    # peak is measured (else the peak would be the compiler's)
    assert r["compile_s"] == 0.0
    assert r["alloc"] == r["full"] * 128 / 1024 and r["live"] == r["alloc"]
    assert r["reset"] and 0 < r["run_peak"] <= r["peak"]
    a.child = "full"
    f = memory.child(a)
    assert f["alloc"] == f["full"] == r["full"] and f["compile_s"] == 0.0
