"""A packaged LLM's model card: full-cache accuracy on the synthetic tasks, written into
MODEL.md between the model's markers (`smollm2`, `qwen2.5-coder-0.5b`, ...).

    python scripts/llm_card.py                # SmolLM2: render from the records that exist
    python scripts/llm_card.py --measure plain:1024,2048 chat:1024 --samples 50
    python scripts/llm_card.py --model qwen2.5-coder-0.5b --measure plain:2048 --samples 10

Each sweep is `python -m kvjax.run --model M --method full --task <tasks> --context <list>
--samples N --details` (plain prompts, or `--chat-template`), its records in
docs/results/<dir>/card_<kind>_<contexts>[_<tag>].jsonl (`--tag` names a sweep over other
tasks or sample counts at the same lengths); an interrupted sweep resumes
(`report.run_once`).
A cell is the accuracy with its 95% Wilson interval; a task "judges" compression at a
length when the full cache scores 90% or more there (the bar of docs/results' pages).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import report, tasks  # noqa: E402

# model -> (records folder under docs/results, MODEL.md marker)
MODELS = {"smollm2-135m": ("smollm2", "smollm2"),
          "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b"),
          "qwen2.5-coder-1.5b": ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b")}
BAR = 0.9


def sweep_args(model: str, kind: str, contexts: str, samples: int,
               task_names: list[str], batch_size: int = 8) -> list[str]:
    args = ["--model", model, "--method", "full", "--task", ",".join(task_names),
            "--context", contexts, "--samples", str(samples), "--details",
            *(["--batch-size", str(batch_size)] if batch_size != 8 else [])]
    return args + (["--chat-template"] if kind == "chat" else [])


def cell(r: dict) -> str:
    lo, hi = report.wilson(r["accuracy"] * r["samples"], r["samples"])
    return f"{100 * r['accuracy']:.0f} [{100 * lo:.0f}, {100 * hi:.0f}] (n={r['samples']})"


def table(records: list[dict]) -> str:
    by = {(r["task"], r["context_length"]): r for r in records}
    cols = sorted({k[1] for k in by})
    lines = ["| task | " + " | ".join(str(c) for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for t in tasks.names():
        row = [cell(by[t, c]) if (t, c) in by else "not run" for c in cols]
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    toks = {c: [r["prompt_tokens"] for r in records if r["context_length"] == c] for c in cols}
    span = "; ".join(f"{c}: {min(p['min'] for p in v)}-{max(p['max'] for p in v)}"
                     for c, v in toks.items())
    return "\n".join(lines) + f"\n\nPrompt tokens (min-max over the cells' samples): {span}."


def judges(records: list[dict]) -> str:
    ok: dict[int, list[str]] = {}
    for r in sorted(records, key=lambda r: (r["context_length"], r["task"])):
        if r["accuracy"] >= BAR:
            ok.setdefault(r["context_length"], []).append(r["task"])
    if not ok:
        return "No task reaches 90% with the full cache."
    return "\n".join(f"- at {c}: {', '.join(v)}" for c, v in sorted(ok.items()))


RULER_BAR = 0.8  # "solved": the full cache at 80% or more (the RULER issue's bar)


def _ruler_cell(r: dict) -> str:
    """RULER's metric over the samples: a Wilson interval where each sample scores 0 or 1
    (one reference, or qa's any-reference match), else the mean with a paired-bootstrap
    95% interval (kvjax.claims.bootstrap, seed 0) and `~`."""
    from kvjax import claims

    scores = [d["score"] for d in r["details"]]
    n, m = len(scores), sum(scores) / len(scores)
    binary = "qa_" in r["task"] or all(len(d["answer"]) == 1 for d in r["details"])
    if binary:
        lo, hi = report.wilson(sum(scores), n)
        return f"{100 * m:.0f} [{100 * lo:.0f}, {100 * hi:.0f}] (n={n})"
    lo, hi = claims.bootstrap(scores, [0.0] * n)
    return f"~{100 * m:.0f} [{100 * lo:.0f}, {100 * hi:.0f}] (n={n})"


def _cost(r: dict, batch: int = 8) -> tuple[float, float]:
    """(seconds a sample, decode's share) from a record's own clocks: each batch's TTFT
    plus TPOT x the tokens RULER lets it write (the loop stops early only when every
    sample of the batch has stopped, so this bounds decode from above). The batches are
    the record's own count, or for records older than it, those of `batch` (the default
    batch size)."""
    import math

    batches = r.get("batches") or math.ceil(r["samples"] / batch)
    prefill = batches * r["ttft_s"]
    decode = batches * (r["tpot_s"] or 0) * (r["max_new_tokens"] or 0)
    return (prefill + decode) / r["samples"], decode / (prefill + decode)


def ruler_section(model: str) -> str:
    """The model's RULER calibration (ruler_<context>[_tag].jsonl): each task's score with
    the full cache per length, RULER's average, the tasks solved, and the cost."""
    from kvjax.tasks import ruler

    folder = MODELS[model][0]
    paths = sorted((ROOT / "docs" / "results" / folder).glob("ruler_*.jsonl"))
    records = report.load_records(*paths) if paths else []
    if not records:
        return "Not measured yet."
    cols = sorted({(r["context_length"], r["samples"]) for r in records})
    by = {(r["task"], r["context_length"], r["samples"]): r for r in records}
    head = " | ".join(f"{c} (n={n})" for c, n in cols)
    lines = [f"| task | {head} |", "|---|" + "---|" * len(cols)]
    for t in ruler.NAMES:
        cells = [_ruler_cell(by[f"ruler/{t}", c, n]) if (f"ruler/{t}", c, n) in by
                 else "not run" for c, n in cols]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    avg = []
    for c, n in cols:
        rs = [by[f"ruler/{t}", c, n] for t in ruler.NAMES if (f"ruler/{t}", c, n) in by]
        mean = 100 * sum(r["accuracy"] for r in rs) / len(rs)
        # over a subset it is only that subset's mean, not comparable with RULER's average
        avg.append(f"{mean:.1f}" + (f" ({len(rs)} of {len(ruler.NAMES)} tasks)"
                                    if len(rs) < len(ruler.NAMES) else ""))
    lines.append("| **RULER average** | " + " | ".join(avg) + " |")
    solved = "\n".join(
        f"- at {c} (n={n}): " + (", ".join(t for t in ruler.NAMES if (f"ruler/{t}", c, n) in by
                                          and by[f"ruler/{t}", c, n]["accuracy"] >= RULER_BAR)
                                 or "none")
        for c, n in cols)
    cost = ["| task | " + " | ".join(f"{c} s/sample (decode share)" for c, _ in cols) + " |",
            "|---|" + "---|" * len(cols)]
    for t in ruler.NAMES:
        cells = []
        for c, n in cols:
            r = by.get((f"ruler/{t}", c, n))
            cells.append("-" if r is None else "{:.1f} ({:.0%})".format(*_cost(r)))
        cost.append(f"| {t} | " + " | ".join(cells) + " |")
    files = ", ".join(f"`{p.name}`" for p in paths)
    return (f"RULER's 13 tasks as RULER generates them (docs/ruler.md), plain (base) prompts, "
            f"the full cache; {report.model_line(records)}; records in docs/results/{folder}/: "
            f"{files}. Score in % with RULER's metric: a 95% Wilson interval where a sample "
            "scores 0 or 1, else (`~`) the mean share of the references written, with a "
            "bootstrap interval. RULER's average is the mean over the tasks run.\n\n"
            + "\n".join(lines) + f"\n\nTasks solved ({100 * RULER_BAR:.0f}% or more: the tasks "
            "a compression result may use at that length):\n\n" + solved
            + "\n\nCost on this machine (2 cores, other work beside it; from the records' own "
            "TTFT and TPOT, decode at RULER's tokens to generate; the record's batches, or for "
            "records older than that field batches of 8):\n\n"
            + "\n".join(cost))


def render(model: str) -> str:
    folder = MODELS[model][0]
    out = ROOT / "docs" / "results" / folder
    parts = []
    for kind, title in (("plain", "Plain prompts"), ("chat", "With `--chat-template`")):
        paths = sorted(out.glob(f"card_{kind}_*.jsonl"))
        records = report.load_records(*paths) if paths else []
        if not records:
            parts.append(f"**{title}**: not measured yet.")
            continue
        files = ", ".join(f"`{p.name}`" for p in paths)
        parts.append(f"**{title}** ({report.model_line(records)}; records in "
                     f"docs/results/{folder}/: {files}). Accuracy in % [95% Wilson "
                     f"interval]:\n\n{table(records)}\n\nTasks at 90% or more (they can judge "
                     f"a compression method at that length):\n\n{judges(records)}")
    return "\n\n".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", nargs="*", default=[],
                   help="sweeps to run first: KIND:CONTEXTS (KIND plain or chat)")
    p.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--tasks", default=",".join(tasks.names()))
    p.add_argument("--ruler-tasks", default="ruler13",
                   help="the tasks of a `ruler:` sweep (RULER's 13, plain prompts: "
                        "docs/ruler.md); ruler13 leaves out, and says so, a task RULER's "
                        "generator cannot make at the length (qa_1, qa_2 at 1024 for "
                        "SmolLM2: a question's 10 documents do not fit)")
    p.add_argument("--tag", default="", help="a suffix of the records file's name")
    p.add_argument("--batch-size", type=int, default=8, help="kvjax.run's --batch-size "
                   "(the records do not depend on it)")
    a = p.parse_args()
    folder, marker = MODELS[a.model]
    out = ROOT / "docs" / "results" / folder
    for m in a.measure:
        kind, contexts = m.split(":", 1)
        if kind not in ("plain", "chat", "ruler"):
            p.error(f"--measure {m}: KIND is plain, chat or ruler")
        out.mkdir(parents=True, exist_ok=True)
        tag = f"_{a.tag}" if a.tag else ""
        stem = "ruler" if kind == "ruler" else f"card_{kind}"
        report.run_once(out / f"{stem}_{contexts.replace(',', '_')}{tag}.jsonl",
                        sweep_args(a.model, kind, contexts, a.samples,
                                   (a.ruler_tasks if kind == "ruler" else a.tasks).split(","),
                                   a.batch_size),
                        ROOT)
    body = render(a.model)
    report.replace_section(ROOT / "MODEL.md", marker, body)
    if f"<!-- {marker}-ruler -->" in (ROOT / "MODEL.md").read_text():
        report.replace_section(ROOT / "MODEL.md", f"{marker}-ruler", ruler_section(a.model))
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
