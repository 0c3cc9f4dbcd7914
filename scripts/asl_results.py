"""ASL vs FastKV, GemFilter and SnapKV on the bundled model (issue 7) -> docs/results/tiny/asl.md.

    python scripts/asl_results.py                                  # full (hours on CPU)
    python scripts/asl_results.py --samples 1 --context 256 --budgets 48 --out /tmp/asl_res

One `python -m kvjax.run --details` per method over budgets x tasks x contexts, question-aware
(`<out>/asl_<method>.json`, not re-run when present), then `<out>/asl.md`: accuracy; for
`asl`, each sample's selection layer (distribution per task, histogram, retrieval vs
aggregation tasks -- `kvjax.tasks` kinds -- compared in computed text) and the relative rank
variance `var_l / init_var` per layer averaged per task (NaN before L_min and after the
selection layer: a layer's mean is over the samples that reached it). Every number comes
from a measured record.

Budgets (select_k = KV entries per layer and KV head): the paper uses 2048 (default) and 8192
(its Table 8) at 32k-128k contexts; scaled by n / 32768 (docs/methods.md "Conventions") to a 2048 context they
are 128 and 512, with 256 between. (2048 of 128k, 1/64, would be 32 = ASL's window: no k.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import report, tasks  # noqa: E402

METHODS = "full,snapkv,fastkv,gemfilter,asl,asl_full_before,asl_2pass"
TASKS = "niah_single,niah_multikey,kv_retrieval,variable_tracking,common_words"


def run_method(a, method: str) -> Path:
    return report.run_once(a.out / f"asl_{method}.json", [
        "--model", a.model, "--method", method, "--budget", a.budgets, "--task", a.tasks,
        "--context", a.context, "--samples", str(a.samples), "--seed", str(a.seed),
        "--details", "--no-progress", *(x for kv in a.set for x in ("--set", kv))], ROOT)


def col(layer) -> str:
    return "none" if layer is None else f"L{layer}"


def histogram(by_task: dict, layers: list, path: Path) -> Path | None:
    """Grouped bars: samples per selection layer ("none": tau never crossed), one per task."""
    plt = report.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    width, pos = 0.8 / len(by_task), np.arange(len(layers))
    for i, (t, got) in enumerate(by_task.items()):
        ax.bar(pos + i * width, [got.count(x) for x in layers], width, label=t)
    ax.set_xticks(pos + 0.4 - width / 2, [col(x) for x in layers])
    ax.set(xlabel="selection layer", ylabel="samples", title=path.stem)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare(by_task: dict, tau: float) -> str:
    """Computed text: mean selection layer of retrieval vs aggregation tasks."""
    means, parts = {}, []
    for kind in ("retrieval", "aggregation"):
        names = [t for t in by_task if tasks.get(t).kind == kind]
        got = [x for t in names for x in by_task[t]]
        sel = [x for x in got if x is not None]
        means.update({kind: float(np.mean(sel))} if sel else {})
        parts.append(f"{kind} tasks ({', '.join(names) or 'none run'}): " + (
            f"mean selection layer {np.mean(sel):.2f} over the {len(sel)} of {len(got)} samples "
            f"that crossed tau = {tau}" if sel else f"no sample of {len(got)} crossed tau = {tau}"))
    text = "; ".join(parts) + ". "
    if len(means) < 2:
        return text + "The paper's claim (retrieval-heavy tasks select later) is untested here."
    d = means["retrieval"] - means["aggregation"]
    how = "at the same mean layer as" if d == 0 else \
        f"{abs(d):.2f} layers {'later' if d > 0 else 'earlier'} on average than"
    return text + f"Retrieval tasks select {how} aggregation tasks: the paper's claim " + \
        ("(retrieval-heavy tasks select later) holds here." if d > 0 else "does not hold here.")


def selection_sections(records: list[dict], a) -> list[str]:
    rows = [{"task": r["task"], "setting": f"context {r['context_length']}, budget {r['budget']}",
             "tau": r["method_params"]["tau"], "rv": d["relative_variance"],
             "layer": d["selection_layer"] if d["tau_crossed"] else None}
            for r in records if r["method"] == "asl" for d in r.get("details", [])]
    parts = []
    for setting in dict.fromkeys(s["setting"] for s in rows):
        rs = [s for s in rows if s["setting"] == setting]
        by_task = {t: [s["layer"] for s in rs if s["task"] == t] for t in
                   dict.fromkeys(s["task"] for s in rs)}
        rv = np.array([s["rv"] for s in rs], dtype=float)  # [samples, L]
        lmin = int(np.min(np.argmax(np.isfinite(rv), axis=1)))
        layers = [*range(lmin, rv.shape[1]), None]
        head = ["task", "kind", "samples", "crossed tau", "mean", "min", "max", *map(col, layers)]
        dist = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for t, got in by_task.items():
            sel = [x for x in got if x is not None]
            st = [f"{np.mean(sel):.2f}", min(sel), max(sel)] if sel else ["-"] * 3
            dist.append("| " + " | ".join(map(str, [t, tasks.get(t).kind, len(got), len(sel), *st,
                                                   *(got.count(x) for x in layers)])) + " |")
        slug = setting.replace("context ", "c").replace(", budget ", "_b")
        png = histogram(by_task, layers, a.out / f"asl_selection_{slug}.png")
        parts += ["", f"### {setting}", "", compare(by_task, rs[0]["tau"]), "",
                  "Selection layer of `asl` per task (mean/min/max over the samples that crossed "
                  "tau; `none`: no selection, the whole model ran on every token):", "", *dist,
                  "", f"![selection layers, {setting}]({png.name})" if png else
                  "(no histogram: matplotlib is not installed)"]
        curve = [{"task": t, "layer": l, "mean": float(np.nanmean(v)),
                  "n": int(np.isfinite(v).sum())} for t in by_task for l in range(lmin, rv.shape[1])
                 for v in [rv[[s["task"] == t for s in rs], l]] if np.isfinite(v).any()]
        png = report.plot_lines(curve, lambda c: c["task"], lambda c: c["layer"],
                                lambda c: c["mean"], a.out / f"asl_relvar_{slug}.png", "layer",
                                "var_l / init_var", f"ASL relative variance, {setting}")
        parts += ["", "Relative variance `var_l / init_var` per layer (mean over the samples "
                  "that reached the layer, their count in brackets; selection where < tau):", "",
                  report.markdown_table(curve, lambda c: c["task"], lambda c: f"L{c['layer']}",
                                        lambda c: f"{c['mean']:.3f} ({c['n']})", fmt="{}",
                                        row_name="task"),
                  "", f"![relative variance, {setting}]({png.name})" if png else
                  "(no plot: matplotlib is not installed)"]
    return parts


def write_report(records: list[dict], a) -> str:
    out = a.out.resolve()
    out = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    parts = ["# ASL vs FastKV, GemFilter, SnapKV (issue 7) (tiny-retrieval)", "",
             f"Measured by `python scripts/asl_results.py --model {a.model} --samples {a.samples} "
             f"--seed {a.seed} --budgets {a.budgets} --context {a.context} --tasks {a.tasks} "
             f"--methods {a.methods}{''.join(f' --set {kv}' for kv in a.set)} --out {out}`"
             + f"; {report.model_line(records)}. Question-aware; budget = select_k = KV entries "
             "per (layer, KV head), window included (FastKV: its KV budget; it propagates "
             "`tsp_rate` of the prompt).", "",
             "## Accuracy (%)", "",
             report.markdown_table(records, report.method_label,
                                   lambda r: f"{r['task']} @{r['context_length']}",
                                   lambda r: 100 * r["accuracy"], fmt="{:.0f}",
                                   row_name="method @ budget", mean_col=True),
             "", "## ASL's selection layer and relative variance"]
    parts += selection_sections(records, a)
    text = "\n".join(parts) + "\n"
    report.write_page(a.out / "asl.md", text)
    return text


def main(argv=None) -> int:
    p = report.results_parser(__doc__, ROOT / "docs" / "results" / "tiny")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--budgets", default="128,256,512")
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--context", default="2048")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a hyperparameter for every method run (kvjax.run --set), e.g. l_obs=3")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    records = [r for m in a.methods.split(",") for r in report.load_records(run_method(a, m))]
    print(write_report(records, a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
