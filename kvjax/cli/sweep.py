"""The sweep of `python -m kvjax.run`: the jobs (method x budget x task x context) planned
and checked before any work, and each job measured into its record."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys

import numpy as np

from kvjax import report
from kvjax.cli.args import TaskSpec, UsageError, check_tasks
from kvjax.cli.records import BULKY_STATS, machine, versions
from kvjax.cli.schema import Record, Weights
from kvjax.cli.signals import check_signals


def make_method(name: str, budget: int | None, ratio: float | None, n: int, extra: dict):
    """A configured method at a budget (`--budget`), or at kvpress's compression `--ratio`
    of an n-token compressed prompt (`Method.with_ratio`)."""
    from kvjax import methods

    return at_budget(methods.create(name, **extra), budget, ratio, n)


def at_budget(method, budget: int | None, ratio: float | None, n: int):
    """`method` at `--budget` or at `--ratio` of an n-token compressed prompt (neither: as
    configured)."""
    if budget is not None:
        return method.with_budget(budget)
    return method if ratio is None else method.with_ratio(ratio, n)


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
    spans: list | None = None  # per sample: `answer_span` of its prompt, found once


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


def settings_of(args, model, extra: dict) -> dict:
    """What besides (method, budget, ratio, task, context) a record's figures depend on."""
    return {"scenario": args.scenario, "samples": args.samples, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "set": extra, "kernels": args.kernels,
            "details": args.details,
            "weights": Weights.of_checkpoint(str(model.path) if model.path else None).sha256,
            # only where they differ from what records written before they existed ran
            # with, so --resume still matches those
            **({"dtype": _dtype_name(model)} if _dtype_name(model) != "float32" else {}),
            **({"mesh": args.mesh.replace(" ", "")} if args.mesh else {}),
            **({"chat_template": True} if args.chat_template else {}),
            **({"ruler_skip": args.ruler_skip} if args.ruler_skip else {})}


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
    elif spec.kind == "ruler13":  # RULER's own generator, this model's tokenizer counting
        from kvjax.tasks import ruler

        name = spec.name.removeprefix("ruler/")
        if model.tokenizer is None:
            raise ValueError(f"model {model.name!r} has no tokenizer to generate RULER's "
                             "tasks with")
        path = ruler.generate(model.tokenizer, name, context, args.ruler_skip + args.samples)
        spec = dataclasses.replace(spec, path=path, sha256=loaders.sha256(path))
        samples = loaders.load_ruler_jsonl(path, name)[args.ruler_skip:]
        in_file = len(samples) + args.ruler_skip
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
    spans = [answer_span(model, p, s.answer) for s, p in zip(samples, prompts)]
    return Prompts(samples, prompts, questions, new, spec, in_file, selection, spans)


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
    """(method, indices) batches: the samples in chunks of `batch_size`, in order, each
    chunk's samples grouped by their method (a ratio's budget follows each compressed
    length). Every job on the same prompts has the same chunks, whose full prefill the
    jobs share (`measure`)."""
    out = []
    for j in range(0, len(per_sample), batch_size):
        groups: dict = {}
        for i in range(j, min(j + batch_size, len(per_sample))):
            groups.setdefault(per_sample[i], []).append(i)
        out += list(groups.items())
    return out


def _check_job(job: Job, model, base, args) -> None:
    """Configure the job's method for every sample and check it on their lengths exactly as
    `engine.run` would; a refusal names the combination."""
    from kvjax import engine

    d = job.data
    try:
        per_sample = [at_budget(base, job.budget, job.ratio, len(p)) for p in d.prompts]
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
    where = f"task {spec.name} at context {ctx}" if spec.at_context else \
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


def plan(args, model, bases: dict, specs: list[TaskSpec] | None = None,
         omitted: list[str] | None = None) -> list[Job]:
    """Every (method, budget or ratio, task, context) of the sweep, each checked on its
    prompts; a method without a budget (`full`) runs once per task and context; a
    benchmark file once (context None). `bases`: each method as configured
    (`configured`); `specs`: the tasks (`check_tasks`). A member of `ruler13` that RULER's
    generator cannot make at a context (`ruler.CannotGenerate`) is left out, with a line
    saying why appended to `omitted` and printed; named alone, it is an error."""
    from kvjax.tasks import ruler

    specs = specs if specs is not None else check_tasks(args.task)
    cells, data = [], {}
    for s in specs:
        for c in (args.context if s.at_context else [None]):
            try:
                data[s.name, c] = _prompts_for(model, s, c, args)
            except UsageError as e:
                if s.suite is None or not isinstance(e.__cause__, ruler.CannotGenerate):
                    raise
                line = f"{s.suite} at context {c}: {s.name} left out: {e.__cause__}"
                print(f"note: {line}", file=sys.stderr)
                if omitted is not None:
                    omitted.append(line)
                continue
            cells.append((s, c))
    points = [(b, None) for b in args.budget] if args.budget else \
        [(None, r) for r in args.ratio] if args.ratio else [(None, None)]
    jobs, seen = [], set()
    for name, (b, r), (spec, ctx) in itertools.product(args.method, points, cells):
        task = spec.name
        base = bases[name]
        if not base.takes_budget():
            b, r = None, None  # no budget to vary (its record and line say so)
        if (name, b, r, task, ctx) in seen:
            continue
        seen.add((name, b, r, task, ctx))
        job = Job(name, b, r, task, ctx, data[task, ctx])
        _check_job(job, model, base, args)
        jobs.append(job)
    return jobs


def configured(name: str, extra: dict[str, str], args):
    """The method `name` with the --set values typed against its fields: `KEY=V` sets
    every method's KEY, `METHOD.KEY=V` only that method's."""
    from kvjax import methods
    from kvjax.methods import registry

    try:
        methods.get(name)
        typed = {k: registry.parse_value(name, k, v)
                 for k, v in _set_for(name, extra, args.method).items()}
        if "budget" in typed and (args.budget or args.ratio):
            raise ValueError(f"--set budget={typed['budget']} conflicts with "
                             f"--{'budget' if args.budget else 'ratio'}: give one")
        return methods.create(name, **typed)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e


def _set_for(name: str, extra: dict[str, str], names: list[str]) -> dict[str, str]:
    """The --set pairs that apply to method `name` among the sweep's `names`."""
    mine: dict[str, str] = {}
    for key, v in extra.items():
        who, dot, field = key.rpartition(".")
        if not dot:
            who, field = name, key
        elif who not in names:
            raise ValueError(f"--set {key}: {who!r} is not a --method of this run "
                             f"({', '.join(names)})")
        if who != name:
            continue
        if field in mine:
            raise ValueError(f"--set {field} and --set {name}.{field} both set {name}'s "
                             f"{field}: give one")
        mine[field] = v
    return mine


# ---- measuring one job ------------------------------------------------------------------


def measure(model, jobs: list[Job], args, settings: dict, pbar=None, at: dict | None = None,
            batches=None):
    """Run the jobs and yield (job, record) as each finishes. The jobs on the same prompts
    (a task at a context) go chunk by chunk together (`_batches`), each chunk through
    `engine.run_each`: its full prefill runs once for every method that compresses after
    it (`kvjax.engine.shared`; not with --mesh or --no-share-prefill), a batch of part of
    the chunk (a ratio's budget) replaying its rows, and a job's record is yielded after
    its last batch. `batches` (`records.Batches`) keeps each finished batch and gives back
    those a stopped run finished, which are not run again. `at["job"]` names the job
    running (for an error's message)."""
    from kvjax import engine
    from kvjax.pallas import Kernels

    at = at if at is not None else {}
    share = not args.no_share_prefill and model.mesh is None
    groups: dict = {}
    for job in jobs:
        groups.setdefault(id(job.data), []).append(job)
    for group in groups.values():
        d = group[0].data
        results = {id(j): _Result(j) for j in group}
        left = {id(j): len(j.batches) for j in group}
        keys = {id(j): job_key(j, settings) for j in group}
        bs = args.batch_size
        for c in dict.fromkeys(i[0] // bs for j in group for _, i in j.batches):
            rows = list(range(c * bs, min((c + 1) * bs, len(d.prompts))))
            runs = [(j, m, i) for j in group for m, i in j.batches if i[0] // bs == c]
            kept = [batches.get(keys[id(j)], i) if batches else None for j, _, i in runs]
            todo = [r for r, p in zip(runs, kept) if p is None]
            at["job"] = (todo or runs)[0][0]
            gens = iter(engine.run_each(
                model.params, model.cfg, [d.prompts[r] for r in rows],
                [(m, [i - rows[0] for i in idx]) for _, m, idx in todo],
                questions=None if d.questions is None else [d.questions[r] for r in rows],
                max_new_tokens=[d.max_new[r] for r in rows], share=share,
                kernels=Kernels.every(args.kernels), mesh=model.mesh) if todo else ())
            for k, ((job, method, idx), piece) in enumerate(zip(runs, kept)):
                check_signals()
                if piece is None:
                    piece = results[id(job)].piece(model, method, idx, next(gens))
                    if batches is not None:
                        batches.put(keys[id(job)], idx, piece)
                results[id(job)].apply(method, idx, piece)
                if pbar is not None:
                    pbar.update(len(idx))
                left[id(job)] -= 1
                if not left[id(job)]:
                    yield job, results[id(job)].record(model, args, settings)
                at["job"] = runs[min(k + 1, len(runs) - 1)][0]  # the run `gens` makes next


class _Result:
    """One job's batches as they finish, then its record."""

    def __init__(self, job: Job):
        self.job = job
        self.per_sample: list = [None] * len(job.data.samples)
        self.ttft, self.own, self.tpot, self.kernels, self.steps = [], [], [], [], []
        self.live, self.alloc, self.full, self.live_end = [], [], [], []
        self.compile_s, self.extra_stats, self.used, self.dtype, self.mesh = 0.0, {}, {}, None, None

    def piece(self, model, method, idx: list[int], gen) -> dict:
        """What one batch (`gen`, the `Generation` of `method` on the samples `idx`) adds to
        the record, as plain JSON (`records.Batches` keeps it for a resumed sweep; a batch
        run now and one read back add the same)."""
        from kvjax import engine, tasks

        job, d = self.job, self.job.data
        st = gen.stats
        budget = _resolved(method, d, idx).budget_for(max(len(d.prompts[i]) for i in idx))
        samples = []
        for j, (i, toks) in enumerate(zip(idx, gen.tokens)):
            s = d.samples[i]
            pred = model.decode(toks)
            score = tasks.score(job.task, pred, s.answer) if d.spec is None or \
                d.spec.synthetic else tasks.score_sample(s, pred)
            rec = {"prediction": pred, "answer": s.answer, "score": score,
                   "correct": bool(score == 1.0), "depth": s.depth, "budget": budget}
            if d.spec is not None and not d.spec.synthetic:
                rec.update(_sample_id(s))
            if d.spans[i] is not None:
                rec["answer_span"] = d.spans[i]
            for k, v in st.items():
                if k not in (*engine.ENGINE_STATS, *BULKY_STATS) and isinstance(v, list) \
                        and len(v) == len(idx):
                    rec[k] = v[j]
            samples.append([i, rec])
        n = len(idx)
        return json.loads(json.dumps(dict(
            budget=budget, dtype=str(gen.cache.k.dtype), mesh=st["mesh"],
            compile_s=st["compile_s"], ttft=st["ttft_s"], own=st["ttft_own_s"],
            tpot=st["tpot_s"], steps=st["steps_run"], live=st["kv_bytes_live"] / n,
            alloc=st["kv_bytes_allocated"] / n,
            live_end=None if st.get("kv_bytes_live_end") is None
            else st["kv_bytes_live_end"] / n,
            full=st["kv_bytes_full"] / n, kernels=st["kernels"],
            extra={k: v for k, v in st.items()
                   if k not in (*engine.ENGINE_STATS, *BULKY_STATS)},
            samples=samples), default=_plain))

    def apply(self, method, idx: list[int], piece: dict) -> None:
        """Add one batch's `piece` to the record."""
        self.used[_resolved(method, self.job.data, idx)] = piece["budget"]
        self.dtype, self.mesh = piece["dtype"], piece["mesh"]
        self.compile_s += piece["compile_s"]
        self.ttft.append(piece["ttft"])
        self.own.append(piece["own"])
        self.tpot += [piece["tpot"]] if piece["tpot"] is not None else []
        self.steps.append(piece.get("steps"))  # absent from older batches files
        self.live.append(piece["live"])
        self.live_end.append(piece.get("live_end"))  # absent from older batches files
        self.alloc.append(piece["alloc"])
        self.full.append(piece["full"])
        self.kernels.append(piece["kernels"])
        for k, v in piece["extra"].items():
            self.extra_stats.setdefault(k, []).append(v)
        for i, rec in piece["samples"]:
            self.per_sample[i] = rec

    def _method_stats(self, details: bool) -> dict:
        """The method's statistics a batch at a time; with `details` less those each sample
        carries already (`piece` copies a per-sample statistic to its sample): SlimInfer's
        kept blocks were 0.8 MB a record twice over."""
        per_sample = set.intersection(*(set(r) for r in self.per_sample)) if details else set()
        return {k: v for k, v in self.extra_stats.items()
                if k not in BULKY_STATS and k not in per_sample}

    def record(self, model, args, settings: dict) -> dict:
        job, d, per_sample = self.job, self.job.data, self.per_sample
        budgets = sorted(set(self.used.values()), key=lambda v: (v is None, v or 0))
        shared = [o is not None for o in self.own]
        return Record(
            method=job.method,
            budget=budgets[0] if len(budgets) == 1 else budgets,
            ratio=job.ratio,
            scenario=args.scenario,
            task=job.task,
            context_length=job.context,
            samples=len(per_sample),
            seed=args.seed,
            ruler_skip=args.ruler_skip or None,
            batches=len(self.ttft),
            max_new_tokens=max(d.max_new),
            prompt_tokens=_prompt_tokens(d),
            accuracy=float(np.mean([r["score"] for r in per_sample])),
            kv_bytes_live=float(np.mean(self.live)),
            kv_bytes_allocated=float(np.mean(self.alloc)),
            kv_bytes_full=float(np.mean(self.full)),
            kv_fraction=float(np.mean(self.live) / np.mean(self.full)),
            kv_fraction_end=float(np.mean(self.live_end) / np.mean(self.full))
            if self.live_end and None not in self.live_end else None,
            ttft_s=float(np.mean(self.ttft)),
            prefill="shared" if all(shared) else "own" if not any(shared) else "mixed",
            ttft_own_s=float(np.mean([o for o in self.own if o is not None]))
            if any(shared) else None,
            tpot_s=float(np.mean(self.tpot)) if self.tpot else None,
            steps_run=int(sum(self.steps)) if self.steps and None not in self.steps
            else None,
            compile_s=self.compile_s,
            method_stats=self._method_stats(args.details),
            kernels=merge_kernels(self.kernels),
            dtype=self.dtype,
            mesh=self.mesh,
            method_params=dataclasses.asdict(next(iter(self.used))),
            model=model.name,
            model_weights=Weights.of_checkpoint(str(model.path) if model.path else None),
            versions=versions(),
            machine=dict(machine()),
            job=json.loads(job_key(job, settings)),
            **(_benchmark_fields(d, per_sample, args)
               if d.spec is not None and not d.spec.synthetic else {}),
            chat_template=bool(args.chat_template),
            note=f"{job.method} takes no budget: --budget/--ratio not applied"
            if job.budget is None and job.ratio is None and (args.budget or args.ratio) else None,
            details=per_sample if args.details else None,
        ).as_json()


def _plain(x):
    """numpy and jax values as JSON's (a batch's piece is stored as JSON); anything else
    as its text, as the records writer (`records._dumps`) writes it."""
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "__array__"):
        return np.asarray(x).tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    return str(x)  # as the records writer writes what JSON has no type for


def answer_span(model, prompt, answers) -> list[int] | None:
    """[start, end) of the first answer whose tokens sit in exactly one place of the prompt
    ids (a needle's value, planted verbatim), else None. The answer is looked for as
    tokenized alone and after a space (how a value inside a sentence is usually split);
    overlapping matches are one place. Positions count from the prompt's first id (`<bos>`
    where it has one), as the engine's positions do, so a record can say whether a method
    kept the needle (SlimInfer's kept blocks: docs/results/sliminfer.md)."""
    ids = np.asarray(prompt)
    for a in answers:
        hits = []
        for text in (" " + a, a):
            want = np.asarray(model.encode(text, bos=False))
            if 0 < len(want) <= len(ids):
                windows = np.lib.stride_tricks.sliding_window_view(ids, len(want))
                hits += [(int(i), int(i) + len(want))
                         for i in np.flatnonzero((windows == want).all(axis=1))]
        if hits and max(s for s, _ in hits) < min(e for _, e in hits):  # all overlap: one place
            return [min(s for s, _ in hits), max(e for _, e in hits)]
    return None


def _sample_id(s) -> dict:
    """Where a benchmark sample came from: its file line, its own id, its dataset."""
    meta = s.meta
    return {"line": meta.get("line"), "id": meta.get("_id", meta.get("index")),
            "dataset": s.task}


def _benchmark_fields(d: Prompts, per_sample: list[dict], args) -> dict:
    """A benchmark record's extra fields: the file it was measured on (path, sha256, how
    many of its records ran), the prompt lengths, the score per dataset, and every
    prediction, so a result can be rescored and checked: `predictions`, or with
    `--details` the details, which carry the same fields (`report.predictions` reads
    either; RULER's cwe wrote 0.3 MB a file twice)."""
    by: dict[str, list[float]] = {}
    for r in per_sample:
        by.setdefault(r["dataset"], []).append(r["score"])
    return {
        "benchmark": {"kind": d.spec.kind, "path": str(d.spec.path), "sha256": d.spec.sha256,
                      "records_in_file": d.in_file, "fraction": args.fraction or 1.0,
                      "metric": sorted({s.metric for s in d.samples})},
        "accuracy_by_dataset": {k: float(np.mean(v)) for k, v in sorted(by.items())},
        **({} if args.details else {"predictions": report.sample_predictions(per_sample)}),
    }


def _prompt_tokens(d: Prompts) -> dict:
    """{min, mean, max} of the tokens each sample's prompt fed the model (context and
    question, special tokens and chat markup included)."""
    n = [len(p) + (len(d.questions[i]) if d.questions else 0) for i, p in enumerate(d.prompts)]
    return {"min": int(min(n)), "mean": float(np.mean(n)), "max": int(max(n))}


def merge_kernels(per_batch: list[dict]) -> dict[str, str]:
    """{op: implementation} over every batch of a record ("a, b" when batches differed: a
    kernel that fell back to xla for some shapes is not reported as having run alone)."""
    ops: dict[str, set] = {}
    for k in per_batch:
        for op, impl in k.items():
            ops.setdefault(op, set()).update(x.strip() for x in impl.split(","))
    return {op: ", ".join(sorted(v)) for op, v in sorted(ops.items())}
