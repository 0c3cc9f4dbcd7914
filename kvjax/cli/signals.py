"""Ctrl-C and SIGTERM in a sweep: each finished record kept, one line, exit 130 / 143
(docs/reliability.md)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


EXIT_INTERRUPTED = 130  # Ctrl-C (finished records kept)
EXIT_TERMINATED = 143  # SIGTERM, 128 + 15 (finished records kept)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's kill, `timeout`), handled as Ctrl-C is: every finished record
    kept, one line, exit 143."""


# signals received and not yet acted on: the exception a handler raises can land where
# Python ignores it (a garbage-collection callback of XLA's, seen here), so the sweep also
# checks this between batches and records (`check_signals`)
PENDING: list[int] = []


def on_sigterm(signum, frame):
    PENDING.append(signum)
    raise Terminated


def on_sigint(signum, frame):
    PENDING.append(signum)
    raise KeyboardInterrupt


def quiet_unraisable(previous):
    """A `sys.unraisablehook` that drops the handlers' own exceptions where Python swallowed
    them (a garbage-collection callback of XLA's: Python printed "Exception ignored in ...
    Traceback" above the sweep's one line); `PENDING` acts on them. Anything else goes to
    `previous`."""
    def hook(u):
        if isinstance(u.exc_value, KeyboardInterrupt) and PENDING:
            return
        previous(u)
    return hook


def check_signals() -> None:
    """Raise for a signal whose handler's exception was swallowed."""
    if signal.SIGTERM in PENDING:
        raise Terminated
    if PENDING:
        raise KeyboardInterrupt


def stopped(e: KeyboardInterrupt) -> str:
    return "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"


def stop_status(e: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED


@contextlib.contextmanager
def sigint_deferred():
    """Ctrl-C or SIGTERM while a record is written takes effect once it is written: the
    message then counts exactly the records on disk."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGTERM in caught:
        raise Terminated
    if caught:
        raise KeyboardInterrupt


def exit_now(code: int) -> None:
    """Leave the process. After Ctrl-C or SIGTERM XLA's threads may still be compiling or
    running the interrupted batch, and the interpreter's teardown then crashed in them
    (SIGSEGV in 4 of 11 tries): every record is already on disk (fsync'd as it finished),
    so the process ends at once with the status it announced."""
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
