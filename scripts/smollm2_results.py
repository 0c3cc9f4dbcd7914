"""SmolLM2-135M's calibration rows (MODEL.md, `smollm2-calibration` section) and the pooling
page (docs/results/pooling.md, `pooling` section), rendered from the records of
`scripts/sweeps_smollm2.sh` in docs/results/smollm2/ (niah_single, plain prompts, 1024
tokens, 50 samples a cell, seed 0). Nothing is measured here; a cell whose records do not
exist yet says so.

    nice bash scripts/sweeps_smollm2.sh        # the sweeps (resumable), ~6 s a sample on 2 cores
    python scripts/smollm2_results.py          # the two sections
    python scripts/smollm2_results.py --slim F.jsonl  # drop uniform layer_budgets (size)

The rows are judged as `scripts/calibrate.py` judges them (its docstring): 95% Wilson
intervals, a difference inside them a tie.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from calibrate import ANCHORS, at_least, below, cell, fmt  # noqa: E402

from kvjax import report  # noqa: E402

RECORDS = ROOT / "docs" / "results" / "smollm2"
FULL = RECORDS / "card_plain_1024.jsonl"  # the model card's full-cache records, same samples
TASK, CONTEXT = "niah_single", 1024


def load() -> list[dict]:
    files = [FULL, *sorted(RECORDS.glob("calib_*.jsonl")), *sorted(RECORDS.glob("pool_*.jsonl"))]
    return [r for r in report.load_records(*[f for f in files if f.exists()])
            if r["task"] == TASK and r["context_length"] == CONTEXT and r["samples"] >= 50]


def find(records, method, budget=None, scenario="question_aware", **params) -> dict | None:
    """The record of `method` at `budget` whose method parameters include `params`."""
    for r in records:
        p = r.get("method_params") or {}
        if (r["method"] == method and r["scenario"] == scenario
                and (method == "full" or r["budget"] == budget)
                and all(p.get(k) == v for k, v in params.items())):
            return r
    return None


def scored(r: dict | None) -> dict | None:
    return None if r is None else cell([d["score"] for d in r["details"]])


def label(method, budget, **params) -> str:
    extra = "".join(f", {k} {v}" for k, v in params.items())
    return f"{method}@{budget}{extra}"


def calibration(records) -> str:
    full = scored(find(records, "full"))
    rows = []

    def row(key, measured, verdict, why=""):
        rows.append(f"| ({key}) | {measured} | {verdict} | {why} |")

    for params in ({"kernel": 7, "pooling": "max"}, {"kernel": 17, "pooling": "max"}):
        k = f"kernel {params['kernel']}"
        snap = {b: scored(find(records, "snapkv", b, **params)) for b in (128, 64)}
        if snap[128] and full:  # (a) at 1/8
            ok, tie = snap[128]["acc"] >= 0.9 * full["acc"], snap[128]["hi"] >= 0.9 * full["acc"]
            row("a", f"snapkv@128 ({k}) {fmt(snap[128])} vs full {fmt(full)}",
                "holds" if ok else "cannot tell" if tie else "does not hold",
                f"keeps {snap[128]['acc'] / full['acc']:.0%} of full")
        co = scored(find(records, "snapkv", 128, "context_only", **params))
        if co and snap[128]:  # (c)
            row("c", f"snapkv@128 ({k}) question-aware {fmt(snap[128])}, context-only {fmt(co)}",
                "holds" if below(co, snap[128]) else "cannot tell",
                "" if below(co, snap[128]) else "difference inside the intervals")
        for other in ("h2o", "tova"):  # (d): the others at their own defaults
            o = scored(find(records, other, 128))
            if o and snap[128]:
                v, why = at_least(snap[128], o, "snapkv", other)
                row("d", f"snapkv@128 ({k}) {fmt(snap[128])} vs {other}@128 {fmt(o)}",
                    {"pass": "holds", "tie": "holds (a tie)", "fail": "does not hold",
                     "uninformative": "cannot tell"}[v], why)
        for b in (128, 64):  # (e)
            ada = scored(find(records, "ada_snapkv", b, **params))
            if ada and snap[b]:
                v, why = at_least(ada, snap[b], "ada_snapkv", "snapkv")
                row("e", f"@{b} ({k}): ada_snapkv {fmt(ada)} vs snapkv {fmt(snap[b])}",
                    {"pass": "holds", "tie": "holds (a tie)", "fail": "does not hold",
                     "uninformative": "cannot tell"}[v], why)
    stream = find(records, "streaming_llm", 128)
    if stream:  # (b): by needle depth; its 124 recent tokens are the prompt's last ~12%
        bands = [(0.0, 0.8), (0.8, 0.9), (0.9, 1.01)]
        got = [[d["score"] for d in stream["details"] if lo <= d["depth"] < hi]
               for lo, hi in bands]
        out, inside = cell(got[0]), cell(got[2])
        ok = out["lo"] <= 0.05 and inside["n"] and inside["hi"] >= 0.9 * full["acc"]
        row("b", "streaming_llm@128 by needle depth: "
            + ", ".join(f"{lo:.1f}-{min(hi, 1):.1f} {fmt(cell(g))}"
                        for (lo, hi), g in zip(bands, got)),
            "holds" if ok else "does not hold",
            "" if ok else "finds needles far from its window" if out["lo"] > 0.05
            else "misses needles in its window")
    head = ("| row | measured: accuracy % [95% Wilson] | verdict | why |\n"
            "|---|---|---|---|")
    anchors = "\n".join(f"- ({k}) {v}" for k, v in ANCHORS.items())
    return (f"niah_single, plain prompts, {CONTEXT} tokens, question-aware unless said, 50 "
            f"samples a cell, seed 0; {report.model_line(records)}; budgets are entries per "
            "layer and KV head (128 = 1/8, 64 = 1/16). Rendered by `python "
            "scripts/smollm2_results.py` from docs/results/smollm2/.\n\n"
            + head + "\n" + "\n".join(sorted(rows)) + "\n\nThe published results each row "
            "stands for:\n\n" + anchors)


def pooling(records) -> str:
    lines = ["| method | pooling | kernel | @64 (1/16) | @128 (1/8) |", "|---|---|---|---|---|"]
    seen = sorted({(r["method"], r["method_params"].get("pooling"), r["method_params"]["kernel"])
                   for r in records if r["method"] in ("snapkv", "ada_snapkv")
                   and r["scenario"] == "question_aware"})
    for m, pool, k in seen:
        cells = [scored(find(records, m, b, pooling=pool, kernel=k)) for b in (64, 128)]
        lines.append(f"| {m} | {pool} | {k} | "
                     + " | ".join(fmt(c) if c else "not run" for c in cells) + " |")
    full = scored(find(records, "full"))
    return (f"niah_single, plain prompts, {CONTEXT} tokens, question-aware, 50 samples a cell, "
            f"seed 0, window 32; {report.model_line(records)}. Full cache: {fmt(full)}. "
            "Accuracy % [95% Wilson interval]. Rendered by `python scripts/smollm2_results.py` "
            "from docs/results/smollm2/.\n\n" + "\n".join(lines))


BASELINES = [RECORDS / "baselines_2048.jsonl", RECORDS / "baselines_k17_2048.jsonl"]
VERDICT = {"pass": "holds", "tie": "holds (a tie)", "fail": "does not hold",
           "uninformative": "cannot tell"}


def baselines() -> str | None:
    """The post-prefill baselines at 2048 on one shared prefill per batch: a table of
    accuracy, KV and timing per method and budget, then the baselines' claims judged."""
    recs = [r for r in report.load_records(*[f for f in BASELINES if f.exists()])
            if r["samples"] >= 50]
    if not recs:
        return None
    full = scored(find(recs, "full"))

    def name(r):
        k = (r.get("method_params") or {}).get("kernel")
        return r["method"] + (f" (kernel {k})" if k not in (None, 7) else "")

    lines = ["| method | budget | accuracy % [95% Wilson] | kv | TTFT s/batch (own) | "
             "TPOT ms |", "|---|---|---|---|---|---|"]
    for r in sorted(recs, key=lambda r: (r["method"] != "full", name(r), -(r["budget"] or 0))):
        own = f" ({r['ttft_own_s']:.2f})" if r.get("ttft_own_s") is not None else ""
        lines.append(f"| {name(r)} | {r['budget'] or '-'} | {fmt(scored(r))} | "
                     f"{r['kv_fraction']:.3f} | {r['ttft_s']:.1f}{own} | "
                     f"{1e3 * (r['tpot_s'] or 0):.0f} |")
    claims = []
    for b, part in ((256, "1/8"), (128, "1/16")):
        for k in (7, 17):
            snap = scored(find(recs, "snapkv", b, kernel=k))
            if snap is None:
                continue
            for other in ("h2o", "tova", "streaming_llm"):
                o = scored(find(recs, other, b))
                if o:
                    v, why = at_least(snap, o, "snapkv", other)
                    claims.append(f"| SnapKV (kernel {k}) >= {other} at {part} | {fmt(snap)} "
                                  f"vs {fmt(o)} | {VERDICT[v]} | {why} |")
            for other in ("ada_snapkv", "pyramidkv"):
                o = scored(find(recs, other, b, kernel=k))
                if o:
                    v, why = at_least(o, snap, other, "snapkv")
                    claims.append(f"| {other} (kernel {k}) >= SnapKV at {part} | {fmt(o)} "
                                  f"vs {fmt(snap)} | {VERDICT[v]} | {why} |")
    return (f"niah_single, plain prompts, 2048 tokens, question-aware, 50 samples a cell, "
            f"seed 0; {report.model_line(recs)}. Full cache: {fmt(full)}. Budgets are entries "
            "per layer and KV head (256 = 1/8, 128 = 1/16); methods at their papers' defaults "
            "(SnapKV's family: max pooling, kernel 7) and again at kernel 17 "
            "(docs/results/pooling.md). One full prefill per batch of 8 served every method "
            "(`prefill: shared`): TTFT is that prefill plus the method's own compression "
            "(in brackets). Rendered by `python scripts/smollm2_results.py` from "
            "docs/results/smollm2/baselines_*2048.jsonl; the sweep: `scripts/sweeps_smollm2.sh`."
            "\n\n" + "\n".join(lines) + "\n\n| claim | measured | verdict | why |\n"
            "|---|---|---|---|\n" + "\n".join(claims))


def slim(path: Path, every: bool = False) -> None:
    """Drop what makes these records 50 KB each and says nothing here: the per-batch
    `layer_budgets` (the per-sample details repeat them), and the per-sample ones of methods
    whose budget is the same for every layer and head (SnapKV, H2O, TOVA, StreamingLLM at
    `--budget`; Ada-SnapKV's per-head counts stay unless `every`: 25 KB a record)."""
    import json

    out = []
    for r in report.load_records(path):
        (r.get("method_stats") or {}).pop("layer_budgets", None)
        if every or not r["method"].startswith("ada_"):
            for d in r.get("details") or []:
                d.pop("layer_budgets", None)
        out.append(json.dumps(r) + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(out))
    tmp.replace(path)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slim", nargs="+", type=Path, metavar="FILE",
                   help="only drop the uniform layer_budgets of these records files")
    p.add_argument("--every-method", action="store_true",
                   help="with --slim: drop the per-head counts of AdaKV's family too")
    a = p.parse_args(argv)
    if a.slim:
        for f in a.slim:
            slim(f, a.every_method)
        return 0
    records = load()
    report.replace_section(ROOT / "MODEL.md", "smollm2-calibration", calibration(records))
    report.replace_section(ROOT / "docs" / "results" / "pooling.md", "pooling", pooling(records))
    table = baselines()
    if table:
        report.replace_section(ROOT / "docs" / "results" / "baselines.md", "smollm2-baselines",
                               table)
    print(f"rendered from {len(records)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
