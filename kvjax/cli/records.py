"""The records file of `python -m kvjax.run`: what a record carries beside its figures
(machine, versions), the JSON / JSONL writer, and what `--resume` accepts."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from kvjax.cli.args import UsageError


@functools.lru_cache(maxsize=1)
def machine() -> dict:
    """What a record's timings were measured on: without it TTFT and time per token cannot
    be compared between records."""
    import platform

    import jax

    dev = jax.devices()[0]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind,
            "device_count": jax.device_count(), "cpu_threads": threads,
            "cpu": platform.processor() or platform.machine()}


def versions() -> dict:
    import jax

    import kvjax

    return {"kvjax": kvjax.__version__, "jax": jax.__version__}


# method statistics too large for a record (every block's score at every pruning layer of
# every sample: 14.7 MB for one SlimInfer sweep); the API's stats still have them
BULKY_STATS = ("block_scores",)


def _finite(x):
    """NaN/inf (e.g. ASL's relative variance at layers a method never scored) as null: the
    output is strict JSON that any parser reads."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _dumps(x, **kw) -> str:
    return json.dumps(_finite(x), default=str, allow_nan=False, **kw)


# ---- the output: checked first, written as each record finishes ----------------------------


_HELD: dict[str, int] = {}  # records file -> the descriptor holding its lock (`hold`)


def _lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive advisory lock for `path`, or UsageError when
    another process holds it. The lock file sits in the temp folder, named by a hash of
    the absolute path (nothing lands beside the records), and goes with its process
    however that ends (`flock`: no stale lock after a kill). None where there is no
    `fcntl` (Windows): no lock."""
    try:
        import fcntl
    except ImportError:
        return None
    import hashlib

    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    lock = Path(tempfile.gettempdir()) / f"kvjax-records-{key}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"{path}: another process is writing these records now (lock "
                         f"{lock}); wait for it to end, or write another file") from None
    return fd


def hold(path: Path) -> None:
    """Lock `path`'s records for this process until `release_held`: two runs resuming one
    file would each run what it lacks and write it twice (two resumes of one perplexity
    file did, 2026-11-29). Held twice in one process is held once."""
    key = str(path.resolve())
    if key not in _HELD:
        fd = _lock(path)
        if fd is not None:
            _HELD[key] = fd


def release_held() -> None:
    """Release every lock `hold` took (the CLI's end)."""
    while _HELD:
        os.close(_HELD.popitem()[1])


class Output:
    """The records file. Checked before any work (a missing folder, a folder, an unwritable
    path, an existing file without --resume/--overwrite are refused); each record is
    written the moment it is measured: `.jsonl` appends one line, anything else rewrites
    the JSON object to a temporary file and renames it over the output (atomic: a crash
    leaves the previous version, never half a file)."""

    def __init__(self, path: Path | None, resume: bool, overwrite: bool):
        self.path, self.records, self.lines = path, [], path is not None and \
            path.suffix == ".jsonl"
        self.appending = resume  # JSON lines: append to what is there
        self.file_args = None  # a .json output's own command (its "args")
        if path is None:
            return
        if path.is_dir():
            raise UsageError(f"--output {path} is a directory; give a file path")
        if not path.parent.is_dir():
            raise UsageError(f"--output {path}: directory {path.parent} does not exist")
        if path.exists() and not (resume or overwrite):
            raise UsageError(f"--output {path} exists: --resume continues it, --overwrite "
                             "replaces it")
        side = path.with_name(path.name + ".batches")
        if self.lines and side.exists() and not (resume or overwrite):
            # a sweep stopped before its first record: only its batches exist, and a new
            # run would start a new batches file (`Batches`), dropping them
            raise UsageError(f"--output {path}: {side} holds the finished batches of a "
                             "stopped sweep: --resume continues it, --overwrite discards them")
        if path.exists() and not os.access(path, os.W_OK):
            raise UsageError(f"--output {path} is not writable")
        try:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
                pass
        except OSError as e:
            raise UsageError(f"--output {path}: cannot write in {path.parent} "
                             f"({e.strerror})") from e
        hold(path)  # before reading what is there: another writer may be adding to it
        if resume and path.exists():
            from kvjax.report import load_records

            if self.lines:
                self._drop_partial_line()
            try:
                self.records = load_records(path)
            except (ValueError, KeyError, TypeError) as e:
                raise UsageError(f"--output {path} cannot be resumed: {e}") from e
            if not self.lines:
                try:
                    self.file_args = json.loads(path.read_text()).get("args")
                except (ValueError, AttributeError):
                    self.file_args = None

    def _drop_partial_line(self) -> None:
        """A JSON-lines file whose last line was cut off by a kill (no newline after it,
        not JSON): the partial record is dropped, with a warning, so appending continues
        a well-formed file; no finished record is touched."""
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
        except ValueError:
            pass
        else:  # a whole record without its newline: kept, the next one on a line of its own
            with open(self.path, "ab") as f:
                f.write(b"\n")
            return
        with open(self.path, "r+b") as f:
            f.truncate(cut)
        print(f"warning: {self.path}: dropped its last line, a record cut off when a run was "
              f"killed ({len(data) - cut} bytes); the finished records are kept",
              file=sys.stderr)

    def done(self) -> set[str]:
        """The `job` keys already measured (records older than the field match none)."""
        return {json.dumps(r["job"], sort_keys=True) for r in self.records if "job" in r}

    def add(self, record: dict, meta: dict) -> None:
        self.records.append(record)
        if self.path is None:
            return
        if self.lines:
            with open(self.path, "a" if self.appending else "w") as f:
                f.write(_dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.appending = True
        else:
            self.write(meta, complete=False)

    def write(self, meta: dict, complete: bool) -> None:
        """The JSON object, atomically (JSON lines have nothing to rewrite)."""
        if self.path is None or self.lines:
            return
        text = _dumps({"records": self.records, "complete": complete, **meta}, indent=1)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            # mkstemp makes 0600; a records file gets the mode open() gives (0666 - umask),
            # as a .jsonl does
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class Batches:
    """The finished batches of records not yet finished, so that a stopped sweep loses at
    most the batch it was in: `<output>.batches` beside a `.jsonl` output, one JSON line per
    batch (its record's `job` key, its sample indices and what it adds to the record:
    `sweep._Result.piece`). A record is written after its last batch, and with a shared
    prefill every record of a task finishes in the last chunk, so without this a stopped
    sweep lost everything it had measured. `--resume` reads the file and runs only the
    batches it lacks; another run (no --resume) starts a new file; a finished run deletes it.
    A line cut off by a kill is skipped."""

    def __init__(self, out: "Output", resume: bool):
        self.path = out.path.with_name(out.path.name + ".batches") if out.lines else None
        self.items: dict[tuple[str, tuple[int, ...]], dict] = {}
        if self.path is None or not self.path.exists():
            return
        if not resume:
            self.path.unlink()
            return
        for line in self.path.read_text().splitlines():
            try:
                b = json.loads(line)
                self.items[(b["job"], tuple(b["idx"]))] = b["piece"]
            except (ValueError, KeyError, TypeError):
                continue

    def get(self, key: str, idx) -> dict | None:
        return self.items.get((key, tuple(int(i) for i in idx)))

    def put(self, key: str, idx, piece: dict) -> None:
        idx = [int(i) for i in idx]
        self.items[(key, tuple(idx))] = piece
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"job": key, "idx": idx, "piece": piece}) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def finish(self) -> None:
        """Every record is written: the batches are no longer needed."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


# ---- main ------------------------------------------------------------------------------------


def one_line(x) -> str:
    return " ".join(str(x).split())[:2000]


_IDENTITY = ("method", "budget", "ratio", "task", "context", "file_sha256", "fraction",
             "max_samples")


def check_resume(out: "Output", args, settings: dict) -> None:
    """--resume continues the same sweep: every job field besides (method, budget, ratio,
    task, context) of the file's records (samples, seed, scenario, dtype, max_new_tokens,
    --set, ...) must be this command's, and a .json file's own lists of methods, budgets,
    tasks and contexts too; else one error names the first field that differs."""
    if not args.resume:
        return
    for r in out.records:
        job = r.get("job")
        if job is None:
            continue
        for k in sorted((set(job) | set(settings)) - set(_IDENTITY)):
            if job.get(k) != settings.get(k):
                raise UsageError(f"--resume: {args.output} was measured with {k}="
                                 f"{job.get(k)!r}, this command has {k}={settings.get(k)!r}; "
                                 "resume with the same command, or use another --output")
    file_args = out.file_args or {}
    for k in ("method", "budget", "ratio", "task", "context"):
        if k in file_args and file_args[k] != getattr(args, k):
            raise UsageError(f"--resume: {args.output} is the sweep --{k} "
                             f"{_listed(file_args[k])}, this command has --{k} "
                             f"{_listed(getattr(args, k))}; resume with the same command, "
                             "or use another --output")


def _listed(v) -> str:
    return "(none)" if v is None else ",".join(map(str, v)) if isinstance(v, list) else str(v)


def kept_message(out: Output, finished: int, total: int, overwrite: bool = False) -> str:
    if out.path is None:
        return f"{finished} of {total} records finished (no --output: none kept)"
    if overwrite and not finished:  # nothing written: the old file stands, untouched
        return (f"0 of {total} records finished; {out.path} was not touched: the same "
                "command runs the sweep again")
    return (f"{finished} of {total} records finished and kept in {out.path}; the same "
            "command with --resume" + (" in place of --overwrite" if overwrite else "")
            + " runs the rest")
