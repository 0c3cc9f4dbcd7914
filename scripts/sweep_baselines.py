"""Budget sweep of the post-prefill eviction baselines on the bundled model.

    python scripts/sweep_baselines.py                       # the full sweep (hours on CPU)
    python scripts/sweep_baselines.py --samples 5 --budgets 128 --out /tmp/sweep   # a taste

For each scenario (question-aware, context-only) it runs one `python -m kvjax.run` over
methods x budgets x tasks x context:

    python -m kvjax.run --model tiny-retrieval --method full,snapkv,pyramidkv,ada_snapkv,
        ada_pyramidkv,streaming_llm,tova,h2o,observed_attention --budget 64,128,256,512
        --task niah_multikey,kv_retrieval,variable_tracking --context 2048
        --scenario <s> --samples 50 --output <out>/baselines_<s>.json

(`full` runs once per task), then writes `<out>/baselines.md` (accuracy per method x
budget per task and scenario, and live KV bytes as a fraction of the full cache) and
`<out>/baselines.png` (accuracy against budget; matplotlib when importable). A scenario
whose JSON already exists is not run again (delete it to re-measure). Every number comes
from those JSON records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import report  # noqa: E402

METHODS = ("full,snapkv,pyramidkv,ada_snapkv,ada_pyramidkv,streaming_llm,tova,h2o,"
           "observed_attention")
SCENARIOS = ("question_aware", "context_only")


def run_scenario(a, scenario: str, out: Path) -> Path:
    return report.run_once(out / f"baselines_{scenario}.json", [
        "--model", a.model, "--method", a.methods, "--budget", a.budgets, "--task", a.tasks,
        "--context", a.context, "--scenario", scenario, "--samples", str(a.samples),
        "--seed", str(a.seed), "--batch-size", str(a.batch_size),
        *(["--no-progress"] if a.no_progress else [])], ROOT)


def write_report(records: list[dict], a, out: Path) -> str:
    parts = [
        f"Measured by `python scripts/sweep_baselines.py --model {a.model} --samples "
        f"{a.samples} --budgets {a.budgets} --context {a.context} --tasks {a.tasks}` (one "
        "`python -m kvjax.run` per scenario; records in `baselines_<scenario>.json`); "
        f"{report.model_line(records)}. Accuracy in %, {a.samples} samples per cell, seed "
        f"{a.seed}. Budget = KV entries kept per (layer, KV head), window/sinks included; "
        "`kv` = live KV bytes after prefill (and the "
        "context-only question) as a fraction of the full cache.",
    ]
    for scenario in SCENARIOS:
        recs = [r for r in records if r["scenario"] == scenario]
        if not recs:
            continue
        recs = sorted(recs, key=lambda r: (r["method"] != "full", r["method"],
                                           r["budget"] if r["budget"] is not None else -1))
        acc = report.markdown_table(recs, report.method_label, lambda r: r["task"],
                                    lambda r: 100 * r["accuracy"], fmt="{:.0f}",
                                    row_name="method @ budget", mean_col=True)
        kv = report.markdown_table(recs, report.method_label, lambda r: r["task"],
                                   lambda r: r["kv_fraction"], fmt="{:.3f}",
                                   row_name="method @ budget")
        parts += ["", f"### {scenario.replace('_', '-')}", "", "Accuracy (%):", "", acc, "",
                  "Live KV bytes / full:", "", kv]
        budgets_seen = sorted({r["budget"] for r in recs if r["method"] != "full"})
        for task in sorted({r["task"] for r in recs}):
            pts = [r for r in recs if r["task"] == task and r["method"] != "full"]
            # the full cache's (one) measured accuracy drawn as a flat line across budgets
            pts += [{**r, "budget": b} for r in recs if r["task"] == task and
                    r["method"] == "full" for b in budgets_seen]
            png = report.plot_lines(pts, lambda r: r["method"], lambda r: r["budget"],
                                    lambda r: 100 * r["accuracy"],
                                    out / f"baselines_{scenario}_{task}.png", "budget (per head)",
                                    "accuracy (%)", f"{task}, {scenario}, ctx {a.context}",
                                    logx=True)
            if png is not None:
                parts += ["", f"![{task} {scenario}]({png.name})"]
    text = "\n".join(parts) + "\n"
    report.replace_section(out / "baselines.md", "tiny-baselines", text) \
        if (out / "baselines.md").exists() else (out / "baselines.md").write_text(
            "# Post-prefill eviction baselines (tiny-retrieval)\n\n<!-- tiny-baselines -->\n"
            f"{text}<!-- /tiny-baselines -->\n")
    return text


def main(argv=None) -> int:
    p = report.results_parser(__doc__, ROOT / "docs" / "results" / "tiny")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--budgets", default="64,128,256,512")
    p.add_argument("--tasks", default="niah_multikey,kv_retrieval,variable_tracking")
    p.add_argument("--context", default="2048")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    paths = [run_scenario(a, s, a.out) for s in a.scenarios.split(",")]
    records = [r for path in paths for r in json.loads(path.read_text())["records"]]
    print(write_report(records, a, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
