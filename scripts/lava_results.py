"""LAVa / CAKE budget sweep on the bundled model -> docs/results/tiny/lava.md.

    python scripts/lava_results.py                                   # full (hours on CPU)
    python scripts/lava_results.py --samples 2 --budgets 48,64 --context 512 --out /tmp/lava

One `python -m kvjax.run` per scenario over methods x budgets x tasks (records in
`<out>/lava_<scenario>.json`, not re-run when present), then `<out>/lava.md`: accuracy
per method @ budget per task and scenario, accuracy-vs-budget plots, and a heat map of
the layer x KV-head live slots LAVa chose on one sample of each task, with LAVa's and
CAKE's per-layer totals beside each other (`engine.run` stats `layer_budgets`). Budgets
64..512 per head at 2048 tokens: the smallest is ~3% of the context. Every number comes
from a measured record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import report  # noqa: E402

METHODS = "full,snapkv,pyramidkv,ada_snapkv,cake,lava,lava_heads_only,lava_layers_only"
TASKS = "niah_multikey,kv_retrieval,common_words,frequent_words"
SCENARIOS = ("question_aware", "context_only")


def run_scenario(a, scenario: str) -> Path:
    return report.run_once(a.out / f"lava_{scenario}.json", [
        "--model", a.model, "--method", a.methods, "--budget", a.budgets, "--task", a.tasks,
        "--context", a.context, "--scenario", scenario, "--samples", str(a.samples),
        "--seed", str(a.seed), "--no-progress"], ROOT)


def heatmaps(a) -> list[str]:
    """LAVa's live slots [L, K] and LAVa's and CAKE's per-layer totals on the first
    sample of each task (question-aware)."""
    plt = report.pyplot()
    from kvjax import api, engine, methods, tasks

    model = api.load(a.model)
    budget = int(a.budgets.split(",")[0])
    parts, totals = [], {}
    for task in a.tasks.split(","):
        s = tasks.sample(task, int(a.context), np.random.default_rng(a.seed))
        ids = model.encode(s.context + s.question)
        for name in ("lava", "cake"):
            g = engine.run(model.params, model.cfg, [ids], methods.create(name, budget=budget),
                           max_new_tokens=0)
            totals[name, task] = np.asarray(g.stats["layer_budgets"])[0]  # [L, K]
        lb = totals["lava", task]
        parts += ["", f"LAVa @{budget}, {task}: live slots per layer (rows) x KV head:", "",
                  "| layer | " + " | ".join(f"h{h}" for h in range(lb.shape[1])) + " |",
                  "|" + "---|" * (lb.shape[1] + 1)]
        parts += [f"| {l} | " + " | ".join(map(str, row)) + " |" for l, row in enumerate(lb)]
        if plt is not None:
            fig, ax = plt.subplots(figsize=(4, 5))
            im = ax.imshow(lb, aspect="auto", cmap="viridis")
            ax.set_xlabel("KV head")
            ax.set_ylabel("layer")
            ax.set_title(f"LAVa @{budget}: {task}")
            fig.colorbar(im)
            png = a.out / f"lava_heatmap_{task}.png"
            fig.savefig(png, dpi=100, bbox_inches="tight")
            plt.close(fig)
            parts += ["", f"![{task}]({png.name})"]
    # CAKE's layer budgets beside LAVa's: where each puts the shared budget
    keys = [(m, t) for t in a.tasks.split(",") for m in ("lava", "cake")]
    parts += ["", f"Live entries per layer, summed over KV heads, LAVa vs CAKE @{budget} "
              f"(uniform: {budget * lb.shape[1]}), first sample of each task:", "",
              "| layer | " + " | ".join(f"{m} {t}" for m, t in keys) + " |",
              "|" + "---|" * (len(keys) + 1)]
    parts += [f"| {l} | " + " | ".join(str(totals[k][l].sum()) for k in keys) + " |"
              for l in range(lb.shape[0])]
    return parts


def write_report(records: list[dict], a) -> str:
    parts = ["# LAVa and CAKE vs SnapKV, PyramidKV, Ada-SnapKV (tiny-retrieval)",
             "", f"Measured by `python scripts/lava_results.py --model {a.model} --samples "
             f"{a.samples} --budgets {a.budgets} --context {a.context} --tasks {a.tasks}`; "
             f"{report.model_line(records)}. "
             "Accuracy in %; budget = KV entries per (layer, KV head) on average, window "
             "included (LAVa/CAKE share `budget * L * K` over layers and heads)."]
    for scenario in SCENARIOS:
        recs = [r for r in records if r["scenario"] == scenario]
        if not recs:
            continue
        acc = report.markdown_table(recs, report.method_label, lambda r: r["task"],
                                    lambda r: 100 * r["accuracy"], fmt="{:.0f}",
                                    row_name="method @ budget", mean_col=True)
        parts += ["", f"## {scenario.replace('_', '-')}", "", acc]
        for task in sorted({r["task"] for r in recs}):
            pts = [r for r in recs if r["task"] == task and r["method"] != "full"]
            png = report.plot_lines(pts, lambda r: r["method"], lambda r: r["budget"],
                                    lambda r: 100 * r["accuracy"],
                                    a.out / f"lava_{scenario}_{task}.png", "budget (per head)",
                                    "accuracy (%)", f"{task}, {scenario}", logx=True)
            if png is not None:
                parts += ["", f"![{task} {scenario}]({png.name})"]
    parts += ["", "## LAVa's layer x head budgets", *heatmaps(a)]
    text = "\n".join(parts) + "\n"
    report.write_page(a.out / "lava.md", text)
    return text


def main(argv=None) -> int:
    p = report.results_parser(__doc__, ROOT / "docs" / "results" / "tiny")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--budgets", default="64,128,256,512")
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--context", default="2048")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    paths = [run_scenario(a, s) for s in a.scenarios.split(",")]
    records = [r for path in paths for r in json.loads(path.read_text())["records"]]
    print(write_report(records, a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
