import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    """A crashed worker ends the run, naming its test, as `.ci/run` does: otherwise xdist
    (3.8, `--dist loadfile`) re-queues the crashed worker's whole file to a new worker,
    which can then wait forever with the machine idle. Set here, not in `addopts`, so a
    pytest without xdist (the jax 0.11 lowering check of `.ci/run`) still runs.

    pyproject's `addopts` sets `--capture=sys` so that the crash says why: under fd-level
    capture a native abort's own message (XLA's `F... Check failed: ...`, written to fd 2)
    lands in the test's unlinked capture file and is lost with the worker; only
    faulthandler's "Fatal Python error: Aborted" reached the log (the abort of 2026-11-26 in
    test_d2o_code, never reproduced since)."""
    if config.pluginmanager.hasplugin("xdist") and config.option.maxworkerrestart is None:
        config.option.maxworkerrestart = "0"
    _native_stderr_to_a_file(config)


# Each xdist worker's fd 2 (native writes: XLA's LOG lines, a crash's own message,
# faulthandler's dump) goes to a file, printed after the run's last line (`pytest_unconfigure`).
# Live it would sit far above the summary, and a CI log that keeps only its tail lost the
# message of the crash of 2026-11-28 (test_decode_layers, under the CI's jax 0.10.2).
# A file, not a pipe: what a process writes before it aborts is in the file already.
_DIR_ENV = "KVJAX_WORKER_STDERR_DIR"


def _native_stderr_to_a_file(config):
    worker = getattr(config, "workerinput", None)
    if worker is None:
        if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
            # inherited by the workers xdist starts after this hook; only the run that
            # made the folder prints and removes it (a pytest a test starts inherits the
            # variable too)
            config._kvjax_stderr_dir = tempfile.mkdtemp(prefix="kvjax-worker-stderr-")
            os.environ[_DIR_ENV] = config._kvjax_stderr_dir
    elif os.environ.get(_DIR_ENV):
        path = Path(os.environ[_DIR_ENV]) / f"{worker['workerid']}.log"
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)


# XLA:CPU keeps each compiled program's machine code in its own memory maps, and a process
# may hold vm.max_map_count (65530) of them. A worker that ran ~430 tests reached it: LLVM's
# "Cannot allocate memory", then SIGSEGV (CI of 2026-11-28, in test_decode_layers). A test
# module adds up to ~7000 maps here, so the compiled programs (jax's caches and the
# engine's; a later test recompiles what it needs) are dropped between two test files once
# the process holds 28672 maps. Within a file only past 49152: a file's tests may count
# the programs its module fixtures compiled (test_sliminfer's "the variants reuse the
# compiled step" failed when a drop fell between its fixture and its test, CI of the same
# day).
_MAPS_CLEAR_AT = 28672
_MAPS_CLEAR_WITHIN_A_FILE_AT = 49152
_maps_seen = {"peak": 0, "clears": 0}


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def pytest_runtest_teardown(item, nextitem):
    n = _memory_maps()
    _maps_seen["peak"] = max(_maps_seen["peak"], n)
    same_file = (item is not None and nextitem is not None
                 and nextitem.path == item.path)
    if n > (_MAPS_CLEAR_WITHIN_A_FILE_AT if same_file else _MAPS_CLEAR_AT):
        import gc

        from kvjax import engine
        engine.clear_compiled()
        gc.collect()
        _maps_seen["clears"] += 1


def pytest_sessionfinish(session):
    if getattr(session.config, "workerinput", None) is not None and _maps_seen["clears"]:
        os.write(2, (f"kvjax: memory maps peaked at {_maps_seen['peak']} (limit 65530); "
                     f"compiled programs dropped {_maps_seen['clears']} times\n").encode())


def pytest_unconfigure(config):
    """The workers' native stderr, after the run's last line (a log cut to its tail keeps
    it), faulthandler's stack frames left out (the failing test is named above)."""
    d = getattr(config, "_kvjax_stderr_dir", None)
    if d is None or not Path(d).is_dir():
        return
    tr = config.pluginmanager.get_plugin("terminalreporter")
    for log in sorted(Path(d).glob("*.log")):
        lines = [x for x in log.read_text(errors="replace").splitlines()
                 if not x.startswith('  File "')]
        if lines and tr is not None:
            tr.write_sep("-", f"native stderr of worker {log.stem} (fd 2; last "
                         f"{min(len(lines), 25)} of {len(lines)} lines, stack frames left out)")
            tr.write_line("\n".join(lines[-25:]))
    shutil.rmtree(d, ignore_errors=True)
