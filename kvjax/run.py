"""`python -m kvjax.run`: evaluate methods x budgets x tasks x contexts on a model.

One JSON record per (method, budget, task, context) with accuracy, KV bytes and timings
(docs/design.md, "Public contract"). Every figure is measured in this run; nothing is
copied.

A sweep never loses a result (docs/reliability.md): the whole product -- every method at
every budget on every task's prompts, and the output path -- is checked before any work
starts; each record is written as soon as it is measured (`--output x.json`: the JSON
object rewritten atomically; `x.jsonl`: one line appended), so an error, a crash or
Ctrl-C keeps every finished record, and `--resume` runs only what the output lacks. An
existing output is replaced only with `--overwrite`. A bad input is one line,
`error: <what, the bad value, what is allowed>`, and exit status 2 (`--debug` shows the
traceback).
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from pathlib import Path

from kvjax.report import _weights
from kvjax.run_args import (EXIT_USAGE, UsageError, _check_scope, _mesh, check_tasks, parse_args,
                            split_pairs)
from kvjax.run_records import Output, _check_resume, _kept, _one_line
from kvjax.run_signals import (_PENDING, _exit, _on_sigint, _on_sigterm,
                               _sigint_deferred, _stop_status, _stopped)
from kvjax.run_sweep import Job, _configured, _settings, job_key, measure, plan

# compiled programs a sweep keeps before it drops them all (see `_run`)
MAX_EXECUTABLES = 150


def main(argv=None) -> int:
    """The CLI. Returns 0, or 2 after one `error:` line (130 on Ctrl-C, 143 on SIGTERM,
    finished records kept); with --debug an error propagates with its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    main_thread = threading.current_thread() is threading.main_thread()
    _PENDING.clear()
    previous = {sig: signal.signal(sig, h) for sig, h in
                ((signal.SIGTERM, _on_sigterm), (signal.SIGINT, _on_sigint))} \
        if main_thread else {}
    try:
        return _run_main(argv, debug)
    finally:
        for sig, handler in previous.items():  # None: a handler not installed from Python
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _run_main(argv: list[str], debug: bool) -> int:
    try:
        return _main(argv)
    except UsageError as e:
        if debug and e.__cause__ is not None:
            raise e.__cause__
        print(f"error: {_one_line(e.message)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        if debug:
            raise
        print(f"error: {_stopped(e)} before any record was finished", file=sys.stderr)
        return _stop_status(e)
    except (ValueError, OSError) as e:  # refused inputs (model files, tasks, methods)
        if debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 -- a bug: still one line, the traceback on demand
        if debug:
            raise
        print(f"error: internal error, {type(e).__name__}: {_one_line(e)} (rerun with --debug "
              "for the traceback)", file=sys.stderr)
        return EXIT_USAGE


def _first_line(doc: str | None, width: int = 100) -> str:
    """A docstring's first sentence on one line of at most `width` characters
    (`--list-methods`)."""
    para = re.sub(r"(\w)-\n\s*", r"\1-", (doc or "").strip()).split("\n\n")[0]
    para = " ".join(para.split())  # a word hyphenated across lines stays one word
    # a sentence ends at ". " not after an abbreviation ("Eq. 5", "Sec. 4", "et al. 2024")
    line = re.split(r"(?<!\bEq)(?<!\bSec)(?<!\bal)(?<!\be\.g)(?<!\bi\.e)(?<!\bcf)\. ", para)[0]
    line = line.rstrip(".")
    return line if len(line) <= width else line[: width - 3] + "..."


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    from kvjax import methods

    if args.list_methods:
        for n in methods.names():
            print(f"{n:24} {_first_line(methods.get(n).__doc__)}")
        return 0
    if args.list_tasks:
        from kvjax import tasks

        for n in tasks.names():
            print(f"{n:20} {tasks.get(n).kind:11} {tasks.DESCRIPTIONS[n]}")
        print(f"{'ruler:PATH':20} {'file':11} RULER's generated jsonl (a file, or a directory "
              "of task folders)")
        print(f"{'longbench:PATH':20} {'file':11} LongBench's jsonl (a file, or a directory of "
              "them)")
        return 0
    import kvjax

    extra = split_pairs(args.set)
    # names, --set values and the output path fail before the model loads
    bases = {name: _configured(name, extra, args) for name in args.method}
    specs = check_tasks(args.task)
    _check_scope(args, specs)
    out = Output(args.output, args.resume, args.overwrite)
    model = kvjax.load(args.model, dtype=args.dtype, mesh=_mesh(args.mesh))
    if args.chat_template and (model.text_format is None or
                               model.text_format.chat_template is None):
        raise UsageError(f"--chat-template: model {args.model} has no chat template (an HF "
                         "tokenizer_config.json 'chat_template' or chat_template.jinja)")
    # a resume of another sweep is refused before the prompts are built and checked
    settings = _settings(args, model, extra)
    other = {_weights(r)[0] for r in out.records} - {settings["weights"]}
    if other:
        raise UsageError(f"--output {args.output} holds records of other weights "
                         f"{sorted(other, key=str)} than {args.model}'s {settings['weights']}: "
                         "resume into another --output, or --overwrite")
    _check_resume(out, args, settings)
    jobs = plan(args, model, bases, specs)
    done = out.done()
    todo = [j for j in jobs if job_key(j, settings) not in done]
    if args.resume:
        print(f"resume: {len(jobs) - len(todo)} of {len(jobs)} records already in "
              f"{args.output}", file=sys.stderr)
    return _run(model, todo, args, settings, out)


def _run(model, jobs: list[Job], args, settings: dict, out: Output) -> int:
    """Measure the jobs in order, writing each record as it finishes. An error or Ctrl-C
    leaves every finished record in the output and says how to continue."""
    from tqdm import tqdm

    from kvjax import engine

    t0 = time.perf_counter()
    meta = lambda: {"wall_s": time.perf_counter() - t0, "args": {  # noqa: E731
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    finished, at = 0, {}
    try:
        with tqdm(total=sum(len(j.data.samples) for j in jobs), disable=args.no_progress,
                  unit="sample",
                  file=sys.stderr) as pbar:
            pbar.set_description(f"{len(jobs)} records")
            for job, rec in measure(model, jobs, args, settings, pbar, at):
                with _sigint_deferred():  # on disk and counted, or neither
                    out.add(rec, meta())
                    finished += 1
                pbar.write(f"{rec['method']:>16} budget={str(rec['budget']):>5} "
                           f"{job.task:>16} ctx={str(job.context or '-'):>5} acc={rec['accuracy']:.3f} "
                           f"kv={rec['kv_fraction']:.3f} ttft={rec['ttft_s']*1e3:.1f}ms "
                           f"tpot={(rec['tpot_s'] or 0)*1e3:.2f}ms"
                           + (f"  note: {rec['note']}" if "note" in rec else ""))
                # executables stay mapped: a sweep that held ~110 (method, budget) pairs'
                # ran out of memory maps (`engine.clear_compiled`)
                if engine.compiled_count() > MAX_EXECUTABLES:
                    engine.clear_compiled()
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        print(f"error: {_stopped(e)}; {_kept(out, finished, len(jobs))}", file=sys.stderr)
        return _stop_status(e)
    except Exception as e:
        what = _one_line(e) if isinstance(e, (ValueError, OSError)) else \
            f"internal error, {type(e).__name__}: {_one_line(e)} (--debug shows the traceback)"
        raise UsageError(f"{at.get('job', jobs[0]).label()} failed: {what}; "
                         f"{_kept(out, finished, len(jobs))}") from e
    out.write(meta(), complete=True)
    if args.output:
        n = len(out.records)
        print(f"wrote {n} record{'s' if n != 1 else ''} to {args.output}", file=sys.stderr)
    else:
        print("nothing was saved: give --output FILE to keep the records", file=sys.stderr)
    return 0


if __name__ == "__main__":
    _exit(main())
