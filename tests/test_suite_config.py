"""The test command's own configuration (pyproject's pytest options, tests/conftest.py): a
worker that dies natively ends the run, and the log keeps what the dying code printed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CRASH = """
import os


def test_abort():
    os.write(2, b"F0000 fake.cc:1] Check failed: the native message\\n")
    os.abort()


def test_after():
    pass
"""


def test_a_native_abort_ends_the_run_and_keeps_its_message(tmp_path):
    # the suite's conftest beside a test that aborts as XLA's LOG(FATAL) does; the options
    # are pyproject's (-c), the workers xdist's, as in the README's command
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_crash.py").write_text(_CRASH)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         str(tmp_path / "test_crash.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    # fd-level capture kept this line in the test's unlinked capture file, lost with the
    # worker; --capture=sys leaves fd 2 alone
    assert "Check failed: the native message" in out, out[-3000:]
    # ... and it comes after the run's last line (conftest), where a log cut to its tail
    # (CI's) still shows it
    assert r.stdout.rindex("Check failed: the native message") > r.stdout.rindex(" in "), \
        r.stdout[-3000:]
    assert "worker 'gw0' crashed while running 'test_crash.py::test_abort'" in out
    # --max-worker-restart 0 (conftest): no replacement worker runs what is left
    summary = [line for line in out.splitlines() if " in " in line and "failed" in line][-1]
    assert "1 failed" in summary and "passed" not in summary, summary



def test_compiled_programs_are_dropped_before_the_memory_maps_run_out(request, monkeypatch):
    import jax
    import jax.numpy as jnp

    from kvjax import engine
    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if getattr(p, "_MAPS_CLEAR_AT", None) is not None)
    engine.compile_once(jax.jit(jnp.square), (jnp.ones(3),))
    assert engine.compiled_count() > 0
    assert conftest._memory_maps() > 0  # Linux: the count the hook compares
    here = request.node
    monkeypatch.setattr(conftest, "_MAPS_CLEAR_AT", 10**9)
    conftest.pytest_runtest_teardown(here, None)
    assert engine.compiled_count() > 0
    # between two tests of one file (whose module fixtures may have compiled what its tests
    # count) only past the higher mark; at the file's end past the lower one
    monkeypatch.setattr(conftest, "_MAPS_CLEAR_AT", 0)
    conftest.pytest_runtest_teardown(here, here)
    assert engine.compiled_count() > 0
    monkeypatch.setattr(conftest, "_MAPS_CLEAR_WITHIN_A_FILE_AT", 0)
    conftest.pytest_runtest_teardown(here, here)
    assert engine.compiled_count() == 0
    engine.compile_once(jax.jit(jnp.square), (jnp.ones(3),))
    monkeypatch.setattr(conftest, "_MAPS_CLEAR_WITHIN_A_FILE_AT", 10**9)
    conftest.pytest_runtest_teardown(here, None)
    assert engine.compiled_count() == 0
