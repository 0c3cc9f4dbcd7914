import os

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
