"""`python -m kvjax.bench.memory` (docs/results/memory.md): one configuration measured in a
child process of its own, as the benchmark runs each (a process's peak only grows: in the
test process, after other tests, the run would fit in memory the process already holds)."""

import json
import subprocess
import sys

ARGS = ["--context", "1024", "--budget", "128", "--layers", "2"]


def child(name: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvjax.bench.memory", *ARGS, "--child", name],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_child_measures_the_run_not_the_compilation():
    r = child("snapkv")
    # the warm-up compiled the very program engine.run calls: nothing compiles while the
    # peak is measured (else the peak would be the compiler's)
    assert r["compile_s"] == 0.0
    assert r["alloc"] == r["full"] * 128 / 1024 and r["live"] == r["alloc"]
    assert r["reset"] and 0 < r["run_peak"] <= r["peak"]
    f = child("full")
    assert f["alloc"] == f["full"] == r["full"] and f["compile_s"] == 0.0
