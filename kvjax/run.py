"""`python -m kvjax.run`: evaluate methods x budgets x tasks x contexts on a model.

One JSON record per (method, budget, task, context) with accuracy, KV bytes and timings
(docs/design.md, "Public contract"). Every figure is measured in this run; nothing is
copied.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

SCENARIOS = ("question_aware", "context_only")


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x != ""]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvjax.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-retrieval",
                   help="bundled model name or local HF checkpoint directory")
    p.add_argument("--method", type=_csv(str), default=["full"], help="comma-separated methods")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--budget", type=_csv(int), help="KV entries kept per layer and head (list)")
    g.add_argument("--ratio", type=_csv(float), help="compression ratio as in kvpress: the fraction of the context "
                   "removed; keeps int(context * (1 - r)) per layer and head (list)")
    p.add_argument("--task", type=_csv(str), default=["niah_single"], help="comma-separated tasks")
    p.add_argument("--context", type=_csv(int), default=[1024], help="context lengths (tokens)")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenario", choices=SCENARIOS, default="question_aware")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a method hyperparameter (repeatable)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: what each task's answer needs")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--details", action="store_true", help="add per-sample records")
    p.add_argument("--list-methods", action="store_true")
    p.add_argument("--list-tasks", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--kernels", choices=("auto", "xla", "pallas"), default="auto",
                   help="kernel ops (kvjax.pallas): auto = Pallas where the backend compiles it "
                        "(TPU, Hopper GPU), else xla; pallas on CPU runs them interpreted (slow)")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    for r in args.ratio or []:
        if not 0 <= r < 1:
            p.error(f"--ratio values must be in [0, 1) (the fraction removed), got {r}")
    return args


def _value(s: str):
    """A --set value: YAML scalar rules (ints, floats, booleans, null, strings)."""
    import yaml

    return yaml.safe_load(s)


def overrides(pairs: list[str]) -> dict:
    out = {}
    for kv in pairs:
        if "=" not in kv:
            raise SystemExit(f"--set expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        out[k.strip()] = _value(v)
    return out


def ratio_budget(context: int, ratio: float) -> int:
    """kvpress's arithmetic: a compression ratio r keeps int(n * (1 - r)) entries."""
    return max(1, int(context * (1 - ratio)))


def make_method(name: str, budget: int | None, ratio: float | None, context: int, extra: dict):
    """A configured method at a budget (`--budget`, or the kvpress compression `--ratio`)."""
    from kvjax import methods

    method = methods.create(name, **extra)
    if budget is None and ratio is not None:
        budget = ratio_budget(context, ratio)
    return method if budget is None else method.with_budget(budget)


def evaluate(model, method, task: str, context: int, args, budget, ratio, pbar=None) -> dict:
    from kvjax import engine, tasks
    from kvjax.pallas import Kernels

    samples = tasks.generate(task, context_length=context, n=args.samples, seed=args.seed)
    per_sample, ttft, tpot, live, full, compile_s = [], [], [], [], [], 0.0
    extra_stats: dict[str, list] = {}
    for i in range(0, len(samples), args.batch_size):
        batch = samples[i: i + args.batch_size]
        max_new = args.max_new_tokens or max(s.max_new_tokens for s in batch)
        if args.scenario == "question_aware":
            prompts = [model.encode(s.prompt) for s in batch]
            questions = None
        else:
            prompts = [model.encode(s.context) for s in batch]
            questions = [model.encode(s.question, bos=False) for s in batch]
        gen = engine.run(model.params, model.cfg, prompts, method, questions=questions,
                         max_new_tokens=max_new, kernels=Kernels.every(args.kernels))
        st = gen.stats
        compile_s += st["compile_s"]
        ttft.append(st["ttft_s"])
        if st["tpot_s"] is not None:
            tpot.append(st["tpot_s"])
        live.append(st["kv_bytes_live"] / len(batch))
        full.append(st["kv_bytes_full"] / len(batch))
        for k, v in st.items():
            if k not in engine.ENGINE_STATS or k == "kernels":
                extra_stats.setdefault(k, []).append(v)
        for j, (s, toks) in enumerate(zip(batch, gen.tokens)):
            pred = model.decode(toks)
            score = tasks.score(task, pred, s.answer)
            rec = {"prediction": pred, "answer": s.answer, "score": score,
                   "correct": bool(score == 1.0), "depth": s.depth}
            for k, v in st.items():
                if k not in (*engine.ENGINE_STATS, *BULKY_STATS) and isinstance(v, list) \
                        and len(v) == len(batch):
                    rec[k] = v[j]
            per_sample.append(rec)
        if pbar is not None:
            pbar.update(len(batch))
    import jax

    import kvjax

    weights = _provenance(str(model.path) if model.path else None)
    record = {
        "method": method.name,
        "budget": budget if budget is not None else (
            ratio_budget(context, ratio) if ratio is not None else None),
        "ratio": ratio,
        "scenario": args.scenario,
        "task": task,
        "context_length": context,
        "samples": len(samples),
        "seed": args.seed,
        "accuracy": float(np.mean([r["score"] for r in per_sample])),
        "kv_bytes_live": float(np.mean(live)),
        "kv_bytes_full": float(np.mean(full)),
        "kv_fraction": float(np.mean(live) / np.mean(full)),
        "ttft_s": float(np.mean(ttft)),
        "tpot_s": float(np.mean(tpot)) if tpot else None,
        "compile_s": compile_s,
        "method_stats": {k: v for k, v in extra_stats.items()
                         if k not in ("kernels", *BULKY_STATS)},
        "kernels": extra_stats.get("kernels", [{}])[0],
        "method_params": dataclasses.asdict(method),
        "model": model.name,
        "model_weights": weights,
        "versions": {"kvjax": kvjax.__version__, "jax": jax.__version__},
    }
    if args.details:
        record["details"] = per_sample
    return record


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


def main(argv=None) -> int:
    args = parse_args(argv)
    from kvjax import methods

    if args.list_methods:
        print("\n".join(methods.names()))
        return 0
    if args.list_tasks:
        from kvjax import tasks

        for n in tasks.names():
            print(f"{n}\t{tasks.get(n).kind}")
        return 0
    from tqdm import tqdm

    import kvjax
    from kvjax import engine, tasks

    for name in args.method:
        methods.get(name)  # unknown names fail before any work
    for t in args.task:
        tasks.get(t)
    extra = overrides(args.set)
    model = kvjax.load(args.model)
    budgets = [(b, None) for b in args.budget] if args.budget else \
        [(None, r) for r in args.ratio] if args.ratio else [(None, None)]
    runs = []
    for name, (b, r), task, ctx in itertools.product(args.method, budgets, args.task, args.context):
        method = make_method(name, b, r, ctx, extra)
        base = make_method(name, None, None, ctx, extra)
        if base.with_budget(1) == base.with_budget(2):
            b, r = None, None  # a method without a budget (`full`) runs once
        key = (method, task, ctx)
        if key not in [k for k, *_ in runs]:
            runs.append((key, b, r))
    records = []
    total = len(runs) * args.samples
    t0 = time.perf_counter()
    with tqdm(total=total, disable=args.no_progress, unit="sample", file=sys.stderr) as pbar:
        prev = None
        for (method, task, ctx), b, r in runs:
            if method != prev:
                # runs are ordered by (method, budget): the executables of the last one are
                # done with
                engine.clear_compiled()
                prev = method
            pbar.set_description(f"{method.name} b={b if b is not None else r} {task} {ctx}")
            rec = evaluate(model, method, task, ctx, args, b, r, pbar)
            records.append(rec)
            pbar.write(f"{rec['method']:>16} budget={str(rec['budget']):>5} {task:>16} "
                       f"ctx={ctx:>5} acc={rec['accuracy']:.3f} "
                       f"kv={rec['kv_fraction']:.3f} ttft={rec['ttft_s']*1e3:.1f}ms "
                       f"tpot={(rec['tpot_s'] or 0)*1e3:.2f}ms")
    out = {"records": records, "wall_s": time.perf_counter() - t0, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if args.output:
        args.output.write_text(json.dumps(_finite(out), indent=1, default=str, allow_nan=False)
                               + "\n")
        print(f"wrote {len(records)} records to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
