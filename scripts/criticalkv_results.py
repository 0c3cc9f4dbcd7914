"""CriticalKV results: accuracy vs budget (base method vs its critical form) and the
per-layer output perturbation, written to docs/results/tiny/criticalkv.md.

    python scripts/criticalkv_results.py                      # full (hours on CPU)
    python scripts/criticalkv_results.py --samples 2 --budgets 64 --tasks niah_single \
        --out /tmp/crit --perturb-budgets 64 --perturb-samples 1   # a taste

Accuracy: one `python -m kvjax.run` per scenario (context-only = the paper's setting,
and question-aware) over the base methods snapkv, ada_snapkv, pyramidkv, headkv, lava and
their critical forms, 4 budgets (48/2048 = 2.3% ... 256/2048 = 12.5%), context 2048.
Perturbation: for each layer, the sum of ||(o - o_hat) W_O||_1 -- o with the full
context, o_hat with the entries kept after compressing the context alone -- over the last
`window` context queries (the ones the base method scored) and over the question's
queries appended after compression (out-of-sample, as the paper's first decoded token),
under the base selection and the critical selection at the same budget (mean over
samples of a retrieval task). Every number comes from the JSON records / this run.

    python scripts/criticalkv_results.py --model smollm2-135m --perturb-only \
        docs/results/smollm2/critical_perturb_2048.jsonl --perturb-task niah_single \
        --pairs snapkv,ada_snapkv --perturb-budgets 128,256 --perturb-samples 10 --set kernel=17

`--perturb-only FILE` measures only the perturbation and appends one JSON line per base
method, budget and sample (the per-layer sums of both selections) to FILE; a rerun skips
what FILE holds. `--set KEY=VALUE` reaches the methods that have the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import engine, methods, report, tasks  # noqa: E402
from kvjax.api import load  # noqa: E402
from kvjax.engine import layers  # noqa: E402

PAIRS = (("snapkv", "critical_snapkv"), ("ada_snapkv", "critical_adakv"),
         ("pyramidkv", "critical_pyramidkv"), ("headkv", "critical_headkv"),
         ("lava", "critical_lava"))
SCENARIOS = ("context_only", "question_aware")


def run_scenario(a, scenario, out: Path) -> Path:
    ms = ",".join(["full"] + [m for p in PAIRS for m in p])
    return report.run_once(out / f"criticalkv_{scenario}.json", [
        "--model", a.model, "--method", ms, "--budget", a.budgets, "--task", a.tasks,
        "--context", str(a.context), "--scenario", scenario, "--samples", str(a.samples),
        "--seed", str(a.seed), "--no-progress"], ROOT)


def kept(model, name: str, budget: int, ctx: list[int], nq: int,
         sets: dict | None = None) -> np.ndarray:
    """[L, K, n + nq] bool: the context entries `name` keeps after compressing `ctx` alone
    (context-only), and every one of the `nq` question entries appended after it. The
    context is left-padded to its length bucket, as a sweep runs it (one compiled program
    per bucket, not per prompt length)."""
    cfg = model.cfg
    m = methods.create(name, budget=budget, **(sets or {}))
    n = len(ctx)
    tokens, valid = engine.pad_left([ctx], engine.bucket(n), cfg.pad_token_id)
    _, cache, _, _ = engine.prefill(model.params, tokens, valid, cfg=cfg, method=m,
                                    capacity=m.cache_slots(tokens.shape[1], cfg))
    keep = np.zeros((cfg.num_layers, cfg.num_kv_heads, n + nq + 1), bool)  # +1: dead slots
    keep[..., n:] = True
    pos, live = np.asarray(cache.pos[:, 0]), np.asarray(cache.valid[:, 0])
    np.put_along_axis(keep, np.where(live, pos, n + nq), True, axis=-1)
    return keep[..., :-1]


def perturbation(model, keep_MLKN: np.ndarray, ctx: list[int], question: list[int],
                 window: int) -> np.ndarray:
    """[M, 2, L]: for each of M kept sets (`kept`), per layer, the sum over a set of queries
    of ||(o - o_hat) W_O||_1 (jnp, fp32), o over every key before the query, o_hat over the
    kept entries before it. Row 0: the last `window` context queries, the ones the base
    method scored (in-sample). Row 1: the question's queries, appended after compression as
    in the context-only scenario (out-of-sample, like the paper's first decoded token).
    Hidden states come from the full cache, so each layer's number is its own
    perturbation, not an accumulated one; one prefill serves all M sets, the prompt
    left-padded to its length bucket (P slots of padding, attended by no query)."""
    cfg, params = model.cfg, model.params
    n, nq = len(ctx), len(question)
    T = engine.bucket(n + nq)
    P = T - n - nq
    keep = jnp.pad(jnp.asarray(keep_MLKN), [(0, 0)] * 3 + [(P, 0)])  # [M, L, K, T]
    tokens, valid = engine.pad_left([ctx + question], T, cfg.pad_token_id)
    pos_BT = engine.positions(valid, jnp.zeros((1,), jnp.int32))

    def loss(io, rows):  # [M]
        q = io.q[0, rows]  # [r, H, Dh]
        k, v = io.k[0], io.v[0]  # [K, T, Dh]
        H, Dh = q.shape[1], q.shape[2]
        G = H // k.shape[0]
        kh, vh = jnp.repeat(k, G, 0), jnp.repeat(v, G, 0)  # [H, T, Dh]
        lg = jnp.einsum("thd,hnd->htn", q, kh) / np.sqrt(Dh)
        slot = jnp.arange(T)[None, :]
        causal = (slot <= rows[:, None]) & (slot >= P)  # [r, T]
        full = jax.nn.softmax(jnp.where(causal[None], lg, -jnp.inf), -1)
        kp = jnp.repeat(keep[:, io.layer], G, 1)[:, :, None, :] & causal[None, None]
        hat = jax.nn.softmax(jnp.where(kp, lg[None], -jnp.inf), -1)  # [M, H, r, T]
        d = jnp.einsum("mhtn,hnd->mhtd", full[None] - hat, vh)
        return jnp.sum(jnp.abs(jnp.einsum("mhtd,hde->mhte", d, io.wo.reshape(H, Dh, -1))),
                       (1, 2, 3))

    def hook(io, st):
        return jnp.stack([loss(io, P + jnp.arange(n - window, n)),
                          loss(io, P + jnp.arange(n, n + nq))], 1), st

    _, out, _ = layers.prefill_layers(params, cfg, tokens, valid, pos_BT, hook, None)
    return np.asarray(out).transpose(1, 2, 0)  # [L, M, 2] -> [M, 2, L]


def perturbation_records(a) -> None:
    """--perturb-only: one JSON line per (base, budget, sample) appended to the file; one
    prefill per sample measures every base, critical form and budget."""
    import dataclasses

    from kvjax.models.checkpoint import provenance
    from kvjax.cli.args import overrides

    model = load(a.model)
    samples = tasks.generate(a.perturb_task, a.context, n=a.perturb_samples, seed=a.seed)
    done = report.load_records(a.perturb_only) if a.perturb_only.exists() else []
    units = []  # (base, critical, budget, the base's --set values, its window)
    for base, crit in (p for p in PAIRS if p[0] in a.pairs.split(",")):
        fields = {f.name for f in dataclasses.fields(methods.get(base))}
        sets = {k: v for k, v in overrides(a.set).items() if k in fields}
        w = methods.create(base, **sets).window
        units += [(base, crit, int(b), sets, w) for b in a.perturb_budgets.split(",")]
    for i, smp in enumerate(samples):
        # the sample count is part of the key: the task spreads needle depths over it
        keys = [dict(base=b, critical=c, budget=bu, sample=i, samples=a.perturb_samples,
                     set=st, task=a.perturb_task, context=a.context, seed=a.seed)
                for b, c, bu, st, _ in units]
        todo = [(u, key) for u, key in zip(units, keys)
                if not any(all(r.get(k) == v for k, v in key.items()) for r in done)]
        if not todo:
            continue
        ctx, q = model.encode(smp.context), model.encode(smp.question, bos=False)
        for w in {u[4] for u, _ in todo}:  # the window's queries are the base's: a prefill each
            mine = [(u, key) for u, key in todo if u[4] == w]
            e = perturbation(model, np.stack([kept(model, m, bu, ctx, len(q), st)
                                              for (b, c, bu, st, _), _ in mine
                                              for m in (b, c)]), ctx, q, w)
            for j, ((b, c, bu, st, _), key) in enumerate(mine):
                eb, ec = e[2 * j], e[2 * j + 1]
                rec = {**key, "model": model.name, "model_weights": provenance(model.path),
                       **{f"{row}_{m}": [float(x) for x in ee[r]] for r, row in
                          enumerate(("window", "question")) for m, ee in (("base", eb),
                                                                          ("critical", ec))}}
                with open(a.perturb_only, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(b, bu, i, eb.sum(1), ec.sum(1), file=sys.stderr, flush=True)


def perturbation_table(a) -> str:
    model = load(a.model)
    samples = tasks.generate(a.perturb_task, a.context, n=a.perturb_samples, seed=a.seed)
    rows = ["| base | budget | layer | window: base | window: critical | window: critical "
            "lower | question: base | question: critical | question: critical lower |",
            "|---|---|---|---|---|---|---|---|---|"]
    for base, crit in PAIRS:
        w = methods.create(base).window
        for budget in [int(b) for b in a.perturb_budgets.split(",")]:
            eb = np.zeros((2, model.cfg.num_layers))
            ec = np.zeros((2, model.cfg.num_layers))
            for s in samples:
                ctx, q = model.encode(s.context), model.encode(s.question, bos=False)
                e = perturbation(model, np.stack([kept(model, m, budget, ctx, len(q))
                                                  for m in (base, crit)]), ctx, q, w)
                eb += e[0] / len(samples)
                ec += e[1] / len(samples)
            for layer in range(eb.shape[1]):
                cells = [f"{eb[i, layer]:.3g} | {ec[i, layer]:.3g} | "
                         f"{'yes' if ec[i, layer] < eb[i, layer] else 'no'}" for i in (0, 1)]
                rows.append(f"| {base} | {budget} | {layer} | " + " | ".join(cells) + " |")
            rows.append(f"| {base} | {budget} | all | {eb[0].sum():.3g} | {ec[0].sum():.3g} | "
                        f"{(ec[0] < eb[0]).sum()}/{eb.shape[1]} | {eb[1].sum():.3g} | "
                        f"{ec[1].sum():.3g} | {(ec[1] < eb[1]).sum()}/{eb.shape[1]} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = report.results_parser(__doc__, ROOT / "docs" / "results" / "tiny")
    p.add_argument("--budgets", default="48,64,128,256")
    p.add_argument("--tasks", default="niah_multikey,kv_retrieval,variable_tracking")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--perturb-task", default="niah_multikey")
    p.add_argument("--perturb-budgets", default="48,128")
    p.add_argument("--perturb-samples", type=int, default=4)
    p.add_argument("--perturb-only", type=Path, metavar="FILE",
                   help="only the perturbation, appended as JSON lines to FILE (resumable)")
    p.add_argument("--pairs", default=",".join(b for b, _ in PAIRS),
                   help="base methods measured with --perturb-only")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a hyperparameter of the methods that have it (--perturb-only)")
    a = p.parse_args(argv)
    if a.perturb_only:
        perturbation_records(a)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    cmdline = "python scripts/criticalkv_results.py " + " ".join(sys.argv[1:] if argv is None
                                                                  else argv)
    measured = {s: json.loads(run_scenario(a, s, a.out).read_text())["records"]
                for s in a.scenarios.split(",")}
    model = report.model_line([r for recs in measured.values() for r in recs])
    parts = ["# CriticalKV: base methods vs their critical form (tiny-retrieval)", "",
             f"Command: `{cmdline}`. {model[0].upper() + model[1:]}, context {a.context}, "
             f"{a.samples} samples per cell, seed {a.seed}. Budget = entries per (layer, KV "
             "head), window included."]
    for scenario, recs in measured.items():
        order = ["full", *(m for pair in PAIRS for m in pair)]
        recs = sorted(recs, key=lambda r: (order.index(r["method"]), r["budget"] or 0))
        parts += ["", f"## Accuracy (%), {scenario.replace('_', '-')}", "",
                  report.markdown_table(recs, report.method_label, lambda r: r["task"],
                                        lambda r: 100 * r["accuracy"], fmt="{:.0f}",
                                        row_name="method @ budget", mean_col=True)]
        for task in sorted({r["task"] for r in recs}):
            pts = [r for r in recs if r["task"] == task and r["method"] != "full"]
            png = report.plot_lines(pts, lambda r: r["method"], lambda r: r["budget"],
                                    lambda r: 100 * r["accuracy"],
                                    a.out / f"criticalkv_{scenario}_{task}.png",
                                    "budget (per head)", "accuracy (%)",
                                    f"{task}, {scenario}, ctx {a.context}", logx=True)
            if png is not None:
                parts += ["", f"![{task} {scenario}]({png.name})"]
    parts += ["", "## Output perturbation per layer", "",
              "Per layer, the sum over a set of queries of ||(o - o_hat) W_O||_1: o with the "
              "whole context, o_hat with the entries the method kept after compressing the "
              "context alone (context-only), hidden states from the full cache. `window`: "
              "the last `window` context queries, which the base method scored; `question`: "
              "the question's queries, appended after compression (the paper measures the "
              f"first decoded token). Mean over {a.perturb_samples} `{a.perturb_task}` "
              "samples; same budget for both; `all`: the sum over layers and the number of "
              "layers where the critical form is lower.", "",
              perturbation_table(a)]
    text = "\n".join(parts) + "\n"
    (a.out / "criticalkv.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
