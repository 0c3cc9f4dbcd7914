"""One overview of every accuracy record under docs/results -> docs/results/README.md.

    python scripts/results_overview.py                      # reads and writes docs/results
    python scripts/results_overview.py --results DIR --out /tmp/overview

Reads the `python -m kvjax.run` records (JSON) beside the results pages (per-sample
`details` are not read), and writes `<out>/README.md`: for each set of weights, scenario and
context length, one table per task of methods x budgets (accuracy in %, with its Wilson 95%
interval where the task's score is 0 or 1 per sample), one plot (accuracy against the live
KV fraction, a panel per task, a line per method, told apart by colour, marker and dash),
and a link to each page. Nothing is measured here: every number is a record's. Records
measured differently are never merged: other weights, scenario or context length are
another table; a method measured with other parameters (or dtype, or chat template) is a
row of its own, named by what differs; a cell measured twice with other samples or seeds
shows both numbers, and a note says where they come from.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import report  # noqa: E402

# pages in the order of the README's results table; the rows of a method sit with those of
# its page (`rank_rows`)
PAGE_ORDER = ("baselines", "asl", "sliminfer", "lava", "criticalkv", "d2o")
# parameters that follow the budget (one row per method, one column per budget)
BUDGET_KEYS = ("budget", "select_k", "ratio")
# record fields that are part of what was measured, beside the method's parameters
SETTING_KEYS = ("dtype", "chat_template")
SCENARIO_NAMES = {"question_aware": "question-aware", "context_only": "context-only"}


def binary_task(task: str) -> bool:
    """Whether the task scores each sample 0 or 1 (so accuracy x samples is a binomial
    count): a metric that asks for every answer at once, or one answer per sample."""
    try:
        from kvjax import tasks

        t = tasks.get(task)
    except (ImportError, KeyError):
        return False
    metric = getattr(t, "metric", None)
    if metric in ("exact_contains", "ruler_string_match_part"):
        return True
    if metric in ("string_match_all", "ruler_string_match_all"):
        try:
            return all(len(s.answer) == 1 for s in tasks.generate(task, 512, n=2, seed=0))
        except Exception:  # a task that cannot make a 512-token sample: say non-binary
            return False
    return False


# records kept in a folder of their own (docs/results/smollm2/: one JSONL per sweep) belong
# to the page their name starts with, or to these
FOLDER_PAGES = {"card_": "../../MODEL.md", "calib_": "../../MODEL.md", "pool_": "pooling.md",
                "critical_": "criticalkv.md", "passkey_": "baselines.md"}


def page_of(json_path: Path, results: Path) -> str | None:
    """The page a records file belongs to: the `.md` beside it whose name starts the file's
    name (`lava_question_aware.json` -> `lava.md`), the longest such; in a folder without
    pages, the results folder's page so named, or `FOLDER_PAGES`'; None if none does."""
    for folder in (json_path.parent, results):
        best = None
        for md in folder.glob("*.md"):
            if md.name == "README.md":
                continue
            mine = json_path.stem == md.stem or json_path.stem.startswith(md.stem + "_")
            if mine and (best is None or len(md.stem) > len(best.stem)):
                best = md
        if best is not None:
            return best.relative_to(results).as_posix()
        if folder == results or any(folder.glob("*.md")):
            break
    return next((page for prefix, page in FOLDER_PAGES.items()
                 if json_path.stem.startswith(prefix)), None)


def load(results: Path) -> list[dict]:
    """Every accuracy record under `results`, each with `_file` and `_page` added, in file
    order; per-sample `details` dropped. Files that are not `kvjax.run` outputs, and
    `dev_*` files (tuning on a dev seed), are skipped."""
    out = []
    for path in sorted([*results.rglob("*.json"), *results.rglob("*.jsonl")]):
        if path.name.startswith("dev_"):  # tuning runs on a dev seed (pooling.md), not results
            continue
        try:
            recs = report.load_records(path)
        except (ValueError, KeyError, TypeError):
            continue
        page = page_of(path, results)
        for r in recs:
            if not (isinstance(r, dict) and isinstance(r.get("accuracy"), (int, float))
                    and all(k in r for k in ("method", "task", "context_length", "scenario"))):
                continue
            r = {k: v for k, v in r.items() if k != "details"}
            if isinstance(r.get("budget"), list):  # a ratio's [min, max] over the prompts
                r["budget"] = tuple(r["budget"])
            out.append({**r, "_file": path.relative_to(results).as_posix(), "_page": page})
    return out


def _signature(r: dict) -> tuple:
    """What a record was measured with besides its budget: the method's parameters and the
    run's settings that change the numbers (parameter dtype, chat template) where recorded."""
    params = dict(r.get("method_params") or {})
    params = {**(params.pop("base", None) or {}), **params}  # a wrapper's base flattened
    params = {k: v for k, v in params.items() if k not in BUDGET_KEYS}
    params.update({k: r[k] for k in SETTING_KEYS if k in r})
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in params.items()))


def label_variants(records: list[dict]) -> None:
    """`_label` of each record: its method, and where one method was measured with different
    parameters (budgets aside), the parameters in which its variants differ."""
    sigs: dict[str, list[tuple]] = defaultdict(list)
    for r in records:
        s = _signature(r)
        if s not in sigs[r["method"]]:
            sigs[r["method"]].append(s)
    for r in records:
        variants = sigs[r["method"]]
        if len(variants) == 1:
            r["_label"] = r["method"]
            continue
        dicts = [dict(v) for v in variants]
        keys = sorted({k for d in dicts for k in d if len({e.get(k) for e in dicts}) > 1})
        mine = dict(_signature(r))
        r["_label"] = r["method"] + " (" + ", ".join(
            f"{k}={json.loads(mine[k]) if k in mine else '-'}" for k in keys) + ")"


def _weights(r: dict) -> tuple:
    return r.get("model"), *report.record_weights(r)


def _budget_text(b) -> str:
    if b is None:
        return "none"
    if isinstance(b, tuple):
        return "-".join(map(_budget_text, b))
    return str(int(b)) if float(b).is_integer() else f"{b:g}"


def _budget_key(b) -> float:
    return -1.0 if b is None else float(max(b) if isinstance(b, tuple) else b)


def _page_rank(page: str | None) -> tuple:
    stem = Path(page).stem if page else "~"
    top = page.split("/")[0] if page and "/" in page else ""
    # the results folder's own pages first, then each subfolder's (tiny/: the appendix)
    return (top, PAGE_ORDER.index(stem) if stem in PAGE_ORDER else len(PAGE_ORDER), stem,
            page or "")  # the path last: tiny/asl.md and tiny/asl_lobs3/asl.md in one order


def _link(page: str) -> str:
    return f"[{Path(page).with_suffix('').as_posix().lstrip('./')}]({page})"


def rank_rows(records: list[dict]) -> None:
    """`_rank` of each record: its row's place in every table and its line style in every
    plot, the same everywhere: `full` first, then each method under its page (the first, in
    README order, that measured it on more than one task), by name."""
    tasks: dict[str, dict] = defaultdict(lambda: defaultdict(set))
    for r in records:
        tasks[r["_label"]][r["_page"]].add(r["task"])
    home = {}
    for lab, by_page in tasks.items():
        pages = sorted(by_page, key=_page_rank)
        home[lab] = next((pg for pg in pages if len(by_page[pg]) > 1), pages[0])
    full = {r["_label"] for r in records if r["method"] == "full"}
    order = sorted(home, key=lambda lab: (lab not in full, _page_rank(home[lab]), lab))
    for r in records:
        r["_rank"] = order.index(r["_label"])


def row_order(recs: list[dict]) -> list[str]:
    """The row labels of these records, in their `_rank` order."""
    ranks = {r["_label"]: r["_rank"] for r in recs}
    return sorted(ranks, key=ranks.get)


def cell_text(measures: list[tuple], binary: bool, show_n: bool) -> str:
    """One cell: accuracy % and, for a binary task, its Wilson interval; several different
    measurements of the same cell (pages measured apart) are all shown, with ' / '."""
    parts = []
    for acc, n, _seed in measures:
        txt = f"{100 * acc:.0f}"
        if binary:
            lo, hi = report.wilson(acc * n, n)
            txt += f" [{100 * lo:.0f}, {100 * hi:.0f}]"
        parts.append(txt + (f" (n={n})" if show_n else ""))
    return " / ".join(parts)


def _cells(recs: list[dict], task: str, binary: bool) -> tuple[list, dict, dict, list]:
    """(budgets, {(label, budget): cell text}, {label: pages}, notes) of one task."""
    recs = [r for r in recs if r["task"] == task]
    budgets = sorted({r.get("budget") for r in recs}, key=_budget_key)
    measures: dict[tuple, list] = defaultdict(list)
    pages: dict[str, list] = defaultdict(list)
    for r in recs:
        m = (r["accuracy"], r["samples"], r.get("seed"))
        if m not in measures[r["_label"], r.get("budget")]:
            measures[r["_label"], r.get("budget")].append(m)
        if r["_page"] and r["_page"] not in pages[r["_label"]]:
            pages[r["_label"]].append(r["_page"])
    show_n = len({r["samples"] for r in recs}) > 1
    cells, notes = {}, []
    for (label, b), ms in measures.items():
        cells[label, b] = cell_text(ms, binary, show_n)
        if len(ms) > 1:
            files = sorted({r["_file"] for r in recs
                            if r["_label"] == label and r.get("budget") == b})
            notes.append(f"{label} @{_budget_text(b)} on {task}: measured differently in "
                         + ", ".join(f"`{f}`" for f in files))
    return budgets, cells, pages, notes


def _pages_text(pages: list[str]) -> str:
    return ", ".join(_link(p) for p in sorted(pages, key=_page_rank))


def task_table(recs: list[dict], task: str, binary: bool) -> tuple[str, list[str]]:
    """(markdown table of methods x budgets for one task, notes on cells measured twice)."""
    budgets, cells, pages, notes = _cells(recs, task, binary)
    head = ["method", *(f"@{_budget_text(b)}" for b in budgets), "pages"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in row_order([r for r in recs if r["task"] == task]):
        row = [cells.get((label, b), "") for b in budgets]
        lines.append("| " + " | ".join([label, *row, _pages_text(pages[label])]) + " |")
    return "\n".join(lines), notes


def methods_by_tasks(recs: list[dict], tasks: list[str], binary: dict) -> tuple[str, list]:
    """One table of methods x tasks, for a group where every record has the same budget."""
    cells, pages, notes = {}, defaultdict(list), []
    for t in tasks:
        _, c, pg, nt = _cells(recs, t, binary[t])
        cells.update({(label, t): text for (label, _b), text in c.items()})
        for label, ps in pg.items():
            pages[label] += [p for p in ps if p not in pages[label]]
        notes += nt
    head = ["method", *tasks, "pages"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([label, *(cells.get((label, t), "") for t in tasks),
                                 _pages_text(pages[label])]) + " |"
              for label in row_order(recs)]
    return "\n".join(lines), notes


# method families: one colour each, the same in every plot (markers and dashes tell a
# family's methods apart)
FAMILIES = (("SnapKV family", ("snapkv", "ada_snapkv", "pyramidkv", "ada_pyramidkv", "headkv")),
            ("accumulated / recent", ("h2o", "tova", "streaming_llm", "observed_attention")),
            ("LAVa, CAKE", ("lava", "cake")),
            ("CriticalKV", ("critical_",)),
            ("D2O", ("d2o", "roco", "cam")),
            ("ASL, FastKV, GemFilter", ("asl", "fastkv", "gemfilter")),
            ("SlimInfer, LazyLLM", ("sliminfer", "lazyllm")))
PANEL_SERIES = 7  # methods a panel, beside the full cache's line


def family(method: str) -> int:
    for i, (_, names) in enumerate(FAMILIES):
        if any(method == n or (n.endswith("_") and method.startswith(n)) or
               method.startswith(n + "_") for n in names):
            return i
    return len(FAMILIES)


def _panels(recs: list[dict], tasks: list[str]) -> list[tuple[str, list[str]]]:
    """(task, labels) a panel: each task's methods by family, at most PANEL_SERIES a panel
    (a family larger than that split in turn)."""
    out = []
    for task in tasks:
        labels = [lab for lab in row_order([r for r in recs if r["task"] == task])
                  if not lab.startswith("full")]
        method = {r["_label"]: r["method"] for r in recs}
        fams: dict[int, list[str]] = defaultdict(list)
        for lab in labels:
            fams[family(method[lab])].append(lab)
        panel: list[str] = []
        for f in sorted(fams):
            if panel and len(panel) + len(fams[f]) > PANEL_SERIES:
                out.append((task, panel))
                panel = []
            for lab in fams[f]:
                if len(panel) == PANEL_SERIES:
                    out.append((task, panel))
                    panel = []
                panel.append(lab)
        if panel or not out or out[-1][0] != task:
            out.append((task, panel))
    return out


def plot_group(recs: list[dict], tasks: list[str], path: Path, title: str,
               binary: dict | None = None) -> Path | None:
    """Accuracy (%) against live KV fraction with 95% Wilson intervals (tasks scored 0 or 1
    a sample): panels of at most PANEL_SERIES methods, one task each, the methods of a
    family together and in the family's colour; `full` a horizontal line labelled with its
    n; each panel's legend outside it, on the right."""
    plt = report.pyplot()
    if plt is None:
        return None
    panels = _panels(recs, tasks)
    method = {r["_label"]: r["method"] for r in recs}
    within: dict[int, list[str]] = defaultdict(list)
    for lab in sorted(method):
        within[family(method[lab])].append(lab)
    markers, dashes = ("o", "s", "^", "D", "v", "P", "X"), ("-", "--", "-.", ":")

    def style(lab: str) -> dict:
        f = family(method[lab])
        i = within[f].index(lab)
        color = f"C{f}" if f < len(FAMILIES) else "C9"
        return {"color": color, "marker": markers[i % len(markers)],
                "linestyle": dashes[i % len(dashes)], "markerfacecolor": "none",
                "markeredgecolor": color, "markersize": 5, "linewidth": 1.3}

    ncol = min(len(panels), 2)
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(8.2 * ncol, 3.3 * nrow), squeeze=False)
    for ax, (task, labels) in zip(axes.flat, panels):
        here = [r for r in recs if r["task"] == task]
        scored01 = binary[task] if binary and task in binary else binary_task(task)
        fulls = [r for r in here if r["method"] == "full"]
        if fulls:  # one reference line: the full cache measured on the most samples
            r = max(fulls, key=lambda r: r["samples"])
            ax.axhline(100 * r["accuracy"], color="k", linewidth=1.2, linestyle=(0, (1, 1)),
                       label=f"full cache (n={r['samples']})")
        for lab in labels:
            pts = sorted({(r["kv_fraction"], r["accuracy"], r["samples"]) for r in here
                          if r["_label"] == lab and r.get("kv_fraction") is not None})
            if not pts:
                continue
            x = [p[0] for p in pts]
            y = [100 * p[1] for p in pts]
            if scored01:
                ci = [report.wilson(a * n, n) for _, a, n in pts]
                err = [[yy - 100 * lo for yy, (lo, _) in zip(y, ci)],
                       [100 * hi - yy for yy, (_, hi) in zip(y, ci)]]
                ax.errorbar(x, y, yerr=err, capsize=2, elinewidth=0.8, label=lab,
                            **style(lab))
            else:
                ax.plot(x, y, label=lab, **style(lab))
        ax.set_xscale("log", base=2)
        _ticks(ax, [r["kv_fraction"] for r in here if r.get("kv_fraction")])
        ax.set_ylim(-5, 105)
        fams = sorted({FAMILIES[f][0] if f < len(FAMILIES) else "other"
                       for f in (family(method[lab]) for lab in labels)})
        ax.set_title(f"{task}: {', '.join(fams) or 'full cache'}", fontsize=9)
        ax.set_xlabel("live KV / full cache", fontsize=8)
        ax.set_ylabel("accuracy (%)" + ("" if scored01 else ", mean score"), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72, bbox_inches="tight")  # the outside legends are never clipped
    plt.close(fig)
    _quantize(path)
    return path


def _ticks(ax, xs: list[float]) -> None:
    """Powers of two as the x ticks, or, where the points span less than two of them (a log
    axis then shows one tick or none), four ticks spread over the points' range."""
    if not xs:
        return
    lo, hi = min(xs), max(xs)
    ticks = [2.0 ** e for e in range(math.floor(math.log2(lo)), math.ceil(math.log2(hi)) + 1)
             if lo / 1.1 <= 2.0 ** e <= hi * 1.1]  # a point a hair off 1/16 keeps its tick
    if len(ticks) < 3:
        ticks = sorted({float(f"{lo * (hi / lo) ** (i / 3):.2g}") for i in range(4)})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()


def _quantize(path: Path) -> None:
    """Rewrite a PNG with a 64-colour palette (a third of its size; the folder stays small)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def page_list(results: Path, records: list[dict]) -> list[str]:
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        if r["_page"]:
            counts[r["_page"]] += 1
    lines = ["| page | what | records here |", "|---|---|---|"]
    pages = sorted((p.relative_to(results).as_posix() for p in results.rglob("*.md")
                    if p.name != "README.md"), key=lambda p: (_page_rank(p), p))
    for page in pages:
        first = (results / page).read_text().splitlines()[:1]
        title = first[0].lstrip("# ").strip() if first else page
        n = counts.get(page, 0)
        lines.append(f"| {_link(page)} | {title} | "
                     f"{n if n else 'none (timings, memory or kernels)'} |")
    return lines


def _samples_note(records: list[dict]) -> str:
    ns = sorted({r["samples"] for r in records})
    n = ns[0]
    lo, _ = report.wilson(n, n)
    head = (f"Every cell is {n} samples" if len(ns) == 1 else
            f"Cells are {', '.join(map(str, ns))} samples (the smallest: {n})")
    return (f"{head}: one sample is {100 / n:.3g} points, and {n} of {n} reads "
            f"[{100 * lo:.0f}, 100]; read trends across budgets and tasks, not single cells.")


RULES = (
    "How a claim is judged (`kvjax/claims.py`; every row below is a line of "
    "[claims.jsonl](claims.jsonl), written from the records by `python "
    "scripts/smollm2_results.py`, never by hand):\n\n"
    "- **Declared first.** Each paper's comparisons are declared before its sweep: the `pairs` "
    "of each page in `scripts/smollm2_results.py` (versioned with the sweeps, "
    "`scripts/sweeps_smollm2.sh`).\n"
    "- **Paired.** Every method of a sweep answers the same prompts, so two methods are "
    "compared sample by sample: the exact McNemar test (a binomial test on the samples where "
    "they disagree; `a wins : b wins`), and Holm's correction over all of a paper's "
    "comparisons on the model (`p_holm`).\n"
    "- **holds**: p_holm < 0.05 in the claimed direction. **does not hold**: significant the "
    "other way; for a \"no worse than X\" claim (a method against the full cache), the "
    "paired 95% interval of a - b (Newcombe's) lies wholly below -5 points. A \"no worse\" "
    "claim holds when that interval lies wholly above -5 points.\n"
    "- **uninformative**: both arms at or below 10%, or both at or above 95% where the claim "
    "is a difference: such a cell measures nothing. **cannot tell**: anything else.\n"
    "- **Ids.** A claim's id (`#` and 8 hex digits on the pages) is a hash of what it "
    "compares (model, paper, page, task, context, scenario, budget, arms, kind, seed, "
    "records), so it names the same "
    "comparison in every render; its `p_holm` grows as a paper registers more comparisons, "
    "so the pages' hand-written readings cite the id, not the number.\n"
    "- **Tuning held out.** Anything chosen from data (SnapKV's pooling kernel 17) is chosen "
    "on a dev seed (seed 1) and judged on seed 0 (`tuned_on`, `seed`; "
    "[pooling](pooling.md)).")


def _effect(r: dict) -> str:
    """a - b in the row's unit: accuracy points, or (lower better) the NLL a token or the
    summed output perturbation, whose registry units are negated."""
    if r.get("metric") == "nll":
        return f"NLL {r['b_acc'] - r['a_acc']:+.2f}"
    if r.get("metric") == "perturbation":
        return f"perturbation x{r['a_acc'] / r['b_acc']:.2f}"
    return f"{100 * (r['a_acc'] - r['b_acc']):+.0f}"


def verdict_screen(results: Path) -> list[str]:
    """The first screen: the rules, then one row per claim of claims.jsonl (the
    uninformative ones counted per paper)."""
    path = results / "claims.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    order = {v: i for i, v in enumerate(("holds", "does not hold", "cannot tell"))}
    # a stable sort: ties keep the registry's order (ids are hashes, their order means nothing)
    shown = sorted((r for r in rows if r["verdict"] != "uninformative"),
                   key=lambda r: (r["paper"], r["model"], order[r["verdict"]], r["context"]))
    lines = ["| paper | claim | model | task, context | a vs b (budget) | verdict | effect "
             "a - b (points, or as named) | a wins : b wins | p_holm | page |", "|---" * 10 + "|"]
    for r in shown:
        rel = ">" if r["kind"] == "better" else ">= full -5"
        lines.append(
            f"| {r['paper']} | {r['claim']} | {r['model']} | {r['task']}, {r['context']}"
            f"{' (context-only)' if r['scenario'] == 'context_only' else ''} | {r['a']} {rel} "
            f"{r['b']} ({r['budget']}) | **{r['verdict']}** | {_effect(r)} | "
            f"{r['a_wins']} : {r['b_wins']} | "
            f"{r['p_holm']:.2g} | {_link(Path(r['page']).name)} |")
    floor: dict[str, int] = defaultdict(int)
    for r in rows:
        if r["verdict"] == "uninformative":
            floor[r["paper"]] += 1
    counts = defaultdict(int)
    for r in rows:
        counts[r["verdict"]] += 1
    return ["## Verdicts", "", RULES, "",
            f"{len(rows)} comparisons: " + ", ".join(f"{counts[v]} {v}" for v in (
                "holds", "does not hold", "cannot tell", "uninformative")) + ".", "",
            *lines, "",
            "Uninformative (both arms on the floor or at the ceiling; in claims.jsonl with "
            "their reason): " + ", ".join(f"{p} {n}" for p, n in sorted(floor.items())) + ".",
            ""]


def _arms(r: dict) -> str:
    """a vs b in the row's unit: accuracy %, or the NLL a token or the mean summed output
    perturbation (lower better; the registry's units are negated)."""
    unit = {"nll": "NLL", "perturbation": "perturbation"}.get(r.get("metric"))
    if unit:
        return f"{unit} {-r['a_acc']:.3g} vs {-r['b_acc']:.3g}"
    return f"{100 * r['a_acc']:.0f} vs {100 * r['b_acc']:.0f}"


def readme_claims(results: Path, shown: int = 4) -> str:
    """The README's claims table: per paper, claim and model, the verdicts counted, and
    its decided comparisons (holds, does not hold; the first `shown`)."""
    path = results / "claims.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        groups[r["paper"], r["claim"], r["model"]].append(r)
    out = ["| paper | claim | model | holds | does not hold | cannot tell | uninformative | "
           "decided comparisons (a vs b: accuracy % or the row's metric, a wins : b wins) |",
           "|---" * 8 + "|"]
    for (paper, claim, model), rs in sorted(groups.items()):
        n = {v: sum(r["verdict"] == v for r in rs) for v in ("holds", "does not hold",
                                                            "cannot tell", "uninformative")}
        decided = [r for r in rs if r["verdict"] in ("holds", "does not hold")]
        text = "; ".join(
            f"{r['verdict']}: {r['a']} vs {r['b']} ({r['task']} {r['context']}"
            f"{', context-only' if r['scenario'] == 'context_only' else ''}, {r['budget']}): "
            f"{_arms(r)}, {r['a_wins']} : {r['b_wins']}"
            for r in decided[:shown])
        if len(decided) > shown:
            text += f"; {len(decided) - shown} more in the overview"
        out.append(f"| {paper} | {claim} | {model} | {n['holds']} | "
                   f"{n['does not hold']} | {n['cannot tell']} | {n['uninformative']} | "
                   f"{text or 'none'} |")
    return "\n".join(out)


def _header(records: list[dict], files: list[str], weights: list, binary: dict) -> list[str]:
    """The page's title and how to read it: the weights, the cells, the columns."""
    yes = ", ".join(f"`{t}`" for t, b in binary.items() if b)
    no = ", ".join(f"`{t}`" for t, b in binary.items() if not b)
    cells = f"- Cells: accuracy in %, then its Wilson 95% interval in brackets for the tasks " \
        f"scored 0 or 1 per sample ({yes}). "
    if no:
        cells += (f"{no} score each sample by the fraction of its answers given: their cells "
                  "are mean scores, with no interval. ")
    unbudgeted = ", ".join(f"`{m}`" for m in sorted({r["method"] for r in records
                                                      if r.get("budget") is None}))
    models = "; ".join(report.model_line([r for r in records if _weights(r) == w])
                       for w in weights)
    return [
        "## Every accuracy record",
        "",
        ("Every accuracy record of the pages below, in one place: for each scenario and "
         "context length, a table per task of methods x budgets, and a plot. Written by "
         f"`python scripts/results_overview.py` from the {len(records)} records of "
         f"{len(files)} `python -m kvjax.run` outputs in this folder; nothing here is "
         "measured by the script, and every number is a record's. Edit the pages and their "
         "records, then re-run the script."),
        "",
        f"- Weights: {models}." + (" One part per model, the one measured with the most "
                                   "samples a cell first." if len(weights) > 1 else ""),
        cells + _samples_note(records),
        ("- Columns `@B`: the budget the method ran at (`--budget`, or the ratio's "
         "`int(n (1 - r))`; what it bounds differs by method: the \"Budgets\" paragraph of "
         f"the [README](../../README.md)). `@none`: no budget ({unbudgeted}; SlimInfer and "
         "LazyLLM prune by their schedules' fractions of the prompt). The plots put every "
         "method on one axis instead: the live KV bytes after prefill as a fraction of the "
         "full cache."),
        ("- A method measured with different parameters by two pages is two rows, named by "
         "the parameters that differ (e.g. ASL's observation window `l_obs`). A cell "
         "measured by several pages with the same settings shows once when they agree, and "
         "each measurement, with a note at the end, when they do not."),
        ("- Scenarios: question-aware compresses context and question together; "
         "context-only compresses the context alone and appends the question after."),
    ]


def _drop_full_only(records: list[dict]) -> tuple[list[dict], list[str]]:
    """The records less the tasks a (weights, scenario, context) measured with the full
    cache alone (a model card's), and those tasks named."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in records:
        groups[_weights(r), r["scenario"], r["context_length"]].append(r)
    kept, dropped = [], []
    for (w, scenario, ctx), recs in groups.items():
        alone = {r["task"] for r in recs} - {r["task"] for r in recs if r["method"] != "full"}
        dropped += [f"{t} at {ctx} ({w[0]})" for t in sorted(alone)]
        kept += [r for r in recs if r["task"] not in alone]
    return kept, sorted(set(dropped))


def overview(results: Path, out: Path) -> str:
    everything = load(results)
    tiny = sum(r["_file"].startswith("tiny/") for r in everything)
    records, full_only = _drop_full_only([r for r in everything
                                          if not r["_file"].startswith("tiny/")])
    if not records:
        raise SystemExit(f"no kvjax.run accuracy records under {results}")
    by_weights: dict[tuple, list] = defaultdict(list)
    for r in records:
        by_weights[_weights(r)].append(r)
    # the best-measured weights first (the most samples a cell): a real LLM before the
    # bundled model's earlier, smaller runs
    weights = sorted(by_weights, key=lambda w: (-max(r["samples"] for r in by_weights[w]),
                                                str(w)))
    for w in weights:  # rows named and ordered within one model's records
        label_variants(by_weights[w])
        rank_rows(by_weights[w])
    files = sorted({r["_file"] for r in records})
    binary = {t: binary_task(t) for t in sorted({r["task"] for r in records})}
    parts = ["# Results overview", "", *verdict_screen(results),
             *_header(records, files, weights, binary)]
    many = len(weights) > 1
    h = "#" if many else ""
    all_notes = []
    for w in weights:
        groups: dict[tuple, list] = defaultdict(list)
        for r in by_weights[w]:
            groups[r["scenario"], r["context_length"]].append(r)
        if many:
            parts += ["", f"## {report.model_line(by_weights[w])}"]
        for (scenario, ctx), recs in sorted(groups.items(), key=lambda kv: (
                kv[0][0] != "question_aware", kv[0][0], kv[0][1])):
            tasks = sorted({r["task"] for r in recs})
            samples = sorted({r["samples"] for r in recs})
            name = SCENARIO_NAMES.get(scenario, scenario)
            heading = f"{name}, context {ctx}" + (f" ({w[0]})" if many else "")
            seeds = ", ".join(sorted({str(r.get("seed")) for r in recs}))
            pages = ", ".join(_link(p) for p in sorted({r["_page"] for r in recs if r["_page"]},
                                                       key=_page_rank))
            parts += ["", f"{h}## {heading}", "",
                      (f"{len(recs)} records; {', '.join(map(str, samples))} samples a cell, "
                       f"seed {seeds}; from {pages}.")]
            stem = f"overview_{scenario}_{ctx}" + (f"_{w[1][:8]}" if many else "")
            png = plot_group(recs, tasks, out / f"{stem}.png",
                             f"{w[0]}, {name}, context {ctx}: accuracy vs live KV fraction "
                             f"({'/'.join(map(str, samples))} samples a point)", binary)
            if png is not None:
                parts += ["", f"![{heading}]({png.name})"]
            if len({r.get("budget") for r in recs}) == 1:  # one column a task: one table
                table, notes = methods_by_tasks(recs, tasks, binary)
                parts += ["", ("Accuracy %, Wilson 95% interval (mean score % where no "
                               f"interval), budget {_budget_text(recs[0].get('budget'))}:"),
                          "", table]
                all_notes += notes
                continue
            for task in tasks:
                table, notes = task_table(recs, task, binary[task])
                kind = "accuracy %, Wilson 95% interval" if binary[task] else \
                    "mean score % (not 0/1 per sample: no interval)"
                parts += ["", f"{h}### {task}, {heading}", "", f"{kind}:", "", table]
                all_notes += notes
    if all_notes:
        parts += ["", "## Cells measured differently by two pages", "",
                  *[f"- {n}" for n in all_notes]]
    if full_only:
        parts += ["", "## Measured with the full cache alone", "",
                  "Not in the tables (no method to compare them with; MODEL.md has them): "
                  + ", ".join(full_only) + "."]
    parts += ["", "## Pages", "", *page_list(results, records)]
    if tiny:
        parts += ["", f"The earlier results on the bundled tiny-retrieval model ({tiny} "
                  "records, 8 samples a cell; not a language model) are an appendix, not "
                  "tabled here: [tiny/](tiny/README.md)."]
    text = "\n".join(parts) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results",
                   help="folder of the results pages and their kvjax.run records")
    p.add_argument("--out", type=Path, default=None,
                   help="where README.md and its plots go (default: --results)")
    a = p.parse_args(argv)
    text = overview(a.results, a.out or a.results)
    if a.out is None and (a.results / "claims.jsonl").exists():
        report.replace_section(ROOT / "README.md", "claims", readme_claims(a.results))
    print(f"wrote {(a.out or a.results) / 'README.md'} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
