"""SmolLM2-135M's calibration rows (MODEL.md, `smollm2-calibration` section) and the pooling
page (docs/results/pooling.md, `pooling` section), rendered from the records of
`scripts/sweeps_smollm2.sh` in docs/results/smollm2/ (niah_single, plain prompts, 1024
tokens, 50 samples a cell, seed 0). Nothing is measured here; a cell whose records do not
exist yet says so.

    nice bash scripts/sweeps_smollm2.sh        # the sweeps (resumable), ~6 s a sample on 2 cores
    python scripts/smollm2_results.py          # the two sections
    python scripts/smollm2_results.py --slim F.jsonl  # drop per-sample layer_budgets (size)

It also renders each results page's SmolLM2 section (baselines, lava, criticalkv, d2o,
sliminfer, asl), the Qwen2.5-Coder-0.5B baselines on RULER (baselines.md, `qwen-baselines`,
from `scripts/sweeps_qwen.sh`'s records in docs/results/qwen2.5-coder-0.5b/) and writes the
claims registry, docs/results/claims.jsonl: every comparison
a page reads (the `pairs` each page declares), judged paired on the same prompts by
`kvjax.claims` (exact McNemar, Holm over a paper's comparisons on the model; the rules in
docs/results/README.md).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from calibrate import ANCHORS, cell, fmt  # noqa: E402

from kvjax import report  # noqa: E402

RECORDS = ROOT / "docs" / "results" / "smollm2"
FULL = RECORDS / "card_plain_1024.jsonl"  # the model card's full-cache records, same samples
TASK, CONTEXT = "niah_single", 1024


def load() -> list[dict]:
    files = [FULL, *sorted(RECORDS.glob("calib_*.jsonl")), *sorted(RECORDS.glob("pool_*.jsonl"))]
    return [{**r, "_files": [str(f.relative_to(ROOT))]}
            for f in files if f.exists() for r in report.load_records(f)
            if r["task"] == TASK and r["context_length"] == CONTEXT and r["samples"] >= 50]


def params(r: dict) -> dict:
    """A record's method parameters, a wrapper's (CriticalKV's) with its base's merged in."""
    p = dict(r.get("method_params") or {})
    return {**p.pop("base", {}), **p}


def find(records, method, budget=None, scenario="question_aware", **want) -> dict | None:
    """The record of `method` at `budget` whose method parameters include `want`."""
    for r in records:
        p = params(r)
        if (r["method"] == method and r["scenario"] == scenario
                and (method == "full" or r["budget"] == budget)
                and all(p.get(k) == v for k, v in want.items())):
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

    def paired(key, ra, rb, part, scenario="question_aware"):
        """A row judged by the claims registry (its verdict cell filled in `main`)."""
        if ra and rb:
            i = _register([ra], [rb], part, scenario)
            rows.append(f"| ({key}) | {ra['method']}{_k(ra)} {fmt(scored(ra))} vs "
                        f"{rb['method']}{_k(rb)}{_co(rb)} {fmt(scored(rb))} | "
                        f"@@claim-row-{i}@@ |")

    PAGE["name"] = "baselines"
    for params in ({"kernel": 7, "pooling": "max"}, {"kernel": 17, "pooling": "max"}):
        snap = {b: find(records, "snapkv", b, **params) for b in (128, 64)}
        paired("a", snap[128], find(records, "full"), "1/8")
        paired("c", snap[128], find(records, "snapkv", 128, "context_only", **params), "1/8",
               "question_aware vs context_only")
        for other in ("h2o", "tova"):  # (d): the others at their own defaults
            paired("d", snap[128], find(records, other, 128), "1/8")
        for b, part in ((128, "1/8"), (64, "1/16")):  # (e)
            paired("e", find(records, "ada_snapkv", b, **params), snap[b], part)
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
    head = ("| row | measured: accuracy % [95% Wilson] | verdict | why (paired: a wins : b "
            "wins, p Holm) |\n|---|---|---|---|")
    anchors = "\n".join(f"- ({k}) {v}" for k, v in ANCHORS.items())
    return (f"niah_single, plain prompts, {CONTEXT} tokens, question-aware unless said, 50 "
            f"samples a cell, seed 0; {report.model_line(records)}; budgets are entries per "
            "layer and KV head (128 = 1/8, 64 = 1/16). Rendered by `python "
            "scripts/smollm2_results.py` from docs/results/smollm2/.\n\n"
            + head + "\n" + "\n".join(sorted(rows)) + "\n\nThe published results each row "
            "stands for:\n\n" + anchors)


def _k(r: dict) -> str:
    k = params(r).get("kernel")
    return ("" if r["method"] == "full" else f" @{r['budget']}"
            + (f" (kernel {k})" if k is not None else ""))


def _co(r: dict) -> str:
    return " context-only" if r["scenario"] == "context_only" else ""


def pooling(records) -> str:
    lines = ["| method | pooling | kernel | @64 (1/16) | @128 (1/8) | @256 (1/4) |",
             "|---|---|---|---|---|---|"]
    seen = sorted({(r["method"], r["method_params"].get("pooling"), r["method_params"]["kernel"])
                   for r in records if r["method"] in ("snapkv", "ada_snapkv")
                   and r["scenario"] == "question_aware"})
    for m, pool, k in seen:
        cells = [scored(find(records, m, b, pooling=pool, kernel=k)) for b in (64, 128, 256)]
        lines.append(f"| {m} | {pool} | {k} | "
                     + " | ".join(fmt(c) if c else "not run" for c in cells) + " |")
    full = scored(find(records, "full"))
    k, why = dev_kernel()
    dev = ("\n\n**The kernel chosen on a dev seed.** Every SnapKV-family claim is judged on "
           "the seed-0 prompts above, so the kernel it uses is chosen on others: seed 1 "
           "(`scripts/sweeps_smollm2.sh`, dev_s1_pool_max_k*_1024.jsonl), SnapKV and "
           "Ada-SnapKV at 1/16 and 1/8, max pooling; mean accuracy over the four cells: "
           f"{why}. " + (f"Chosen: kernel {k}" + (", the kernel the claims use." if k == 17
                                                  else "; the claims still read kernel 17, "
                                                  "chosen on seed 0 (`tuned_on` 0 in "
                                                  "claims.jsonl).") if k else ""))
    return (pooling_intro(records, full) + "\n\n" + "\n".join(lines) + dev
            + digits(records))


def digits(records) -> str:
    """SnapKV at 1/8, kernels 7 and 17, against the needle value's digit count (SmolLM2
    writes a digit a token); "" before the sweep has run."""
    recs = {7: records}
    for d in (3, 5, 10):
        recs[d] = records_at(CONTEXT, f"digits_d{d}", f"digits_d{d}_k17",
                             task=f"niah_single_d{d}")
    if not any(recs[d] for d in (3, 5, 10)):
        return ""
    lines = ["| digits (tokens) | full | snapkv kernel 7 @128 | snapkv kernel 17 @128 |",
             "|---|---|---|---|"]
    for d in sorted(recs):
        cells = [scored(find(recs[d], "full")),
                 *(scored(find(recs[d], "snapkv", 128, kernel=k, pooling="max"))
                   for k in (7, 17))]
        lines.append(f"| {d} | " + " | ".join(fmt(c) if c else "not run" for c in cells) + " |")
    return ("\n\nThe needle's length: niah_single_d3, _d5 and _d10 (7: niah_single), the "
            "same prompts' form with a value of 3, 5 or 10 digits (one token each here); "
            "records docs/results/smollm2/digits_d*_1024.jsonl.\n\n" + "\n".join(lines))


def pooling_intro(records, full) -> str:
    return (f"niah_single, plain prompts, {CONTEXT} tokens, question-aware, 50 samples a cell, "
            f"seed 0, window 32; {report.model_line(records)}. Full cache: {fmt(full)}. "
            "Accuracy % [95% Wilson interval]. Rendered by `python scripts/smollm2_results.py` "
            "from docs/results/smollm2/.")


# the papers claim "better than": a tie cannot show it (MODEL.md's calibration rows, "at
# least as good as", count a tie as consistent)
VERDICT = {"pass": "holds", "tie": "cannot tell (a tie)", "fail": "does not hold",
           "uninformative": "cannot tell"}
CONTEXTS = (2048, 1024, 4096)  # each page's blocks, in this order
# each context's baseline records: SnapKV's family at kernels 7 and 17, H2O, TOVA,
# StreamingLLM and full (at 1024 the calibration's and the model card's)
BASE = {2048: ("baselines", "baselines_k17"),
        1024: ("card_plain", "calib_qa", "pool_snapkv_max_k17", "pool_ada_snapkv_max_k17"),
        4096: ("baselines", "baselines_k17", "h2o")}
K17 = {"kernel": 17}


def budgets(ctx: int) -> tuple:
    return ((ctx // 8, "1/8"), (ctx // 16, "1/16"))


def records_at(ctx: int, *names: str, task: str = TASK) -> list[dict]:
    """The records of `<name>_<ctx>.jsonl` at that context and task, 50 samples or more,
    each with the files it came from (`_files`, for the claims registry)."""
    files = [RECORDS / f"{n}_{ctx}.jsonl" for n in names]
    return [{**r, "_files": [str(f.relative_to(ROOT))]}
            for f in files if f.exists() for r in report.load_records(f)
            if r["samples"] >= 50 and r["context_length"] == ctx and r["task"] == task]


def _name(r: dict) -> str:
    p = params(r)
    k = p.get("kernel")
    return (r["method"] + (f" (kernel {k})" if k not in (None, 7) else "")
            + (f" (TSP rate {p['tsp_rate']:g})" if p.get("tsp_rate") not in (None, 0.2) else "")
            + (" (merge off)" if p.get("merge") is False else ""))


def _kv(r: dict) -> str:
    """The live KV share after the prefill, and after the last token where a method's
    decoding changed it by more than the generated tokens do (d2o_code evicts at its first
    step): records since 2026-11-28 carry it (`kv_fraction_end`)."""
    end = r.get("kv_fraction_end")
    tail = f" (end {end:.3f})" if end is not None and abs(end - r["kv_fraction"]) > 0.05 else ""
    return f"{r['kv_fraction']:.3f}{tail}"


def table(recs: list[dict], methods: set | None = None,
          scenario: str = "question_aware") -> str:
    """Accuracy, KV and timing per method and budget."""
    lines = ["| method | budget | accuracy % [95% Wilson] | kv | TTFT s/batch (own) | "
             "TPOT ms |", "|---|---|---|---|---|---|"]
    top = lambda b: max(b) if isinstance(b, list) else (b or 0)  # noqa: E731
    for r in sorted(recs, key=lambda r: (r["method"] != "full", _name(r), -top(r["budget"]))):
        if (methods is not None and r["method"] not in methods) or (
                r["method"] != "full" and r["scenario"] != scenario):
            continue
        own = f" ({r['ttft_own_s']:.2f})" if r.get("ttft_own_s") is not None else ""
        lines.append(f"| {_name(r)} | {r['budget'] or '-'} | {fmt(scored(r))} | "
                     f"{_kv(r)} | {r['ttft_s']:.1f}{own} | "
                     f"{1e3 * (r['tpot_s'] or 0):.0f} |")
    return "\n".join(lines)


# The papers' comparisons, declared here before their sweeps (each page's `pairs`): each is
# "a beats b" unless b is the full cache, where the claim is "a is no worse than full by
# more than 5 points". The paper a comparison belongs to, by page and by a's method.
PAPER = {"baselines": "SnapKV", "lava": "LAVa", "criticalkv": "CriticalKV", "d2o": "D2O",
         "sliminfer": "SlimInfer", "asl": "ASL"}
PAPER_OF_METHOD = {"ada_snapkv": "AdaKV", "ada_pyramidkv": "AdaKV", "pyramidkv": "PyramidKV",
                   "h2o": "H2O", "tova": "TOVA", "streaming_llm": "StreamingLLM",
                   "observed_attention": "ObservedAttention", "headkv": "HeadKV"}
CLAIM_WORDS = {"SnapKV": "SnapKV keeps what full keeps, above H2O, TOVA and StreamingLLM",
               "AdaKV": "Ada-SnapKV (adaptive head budgets) beats SnapKV",
               "PyramidKV": "PyramidKV beats SnapKV",
               "H2O": "H2O keeps full's accuracy (within 5 points)",
               "TOVA": "TOVA keeps full's accuracy (within 5 points)",
               "StreamingLLM": "StreamingLLM keeps full's accuracy (within 5 points)",
               "ObservedAttention": "ObservedAttention keeps full's accuracy (within 5 points)",
               "HeadKV": "HeadKV (head budgets from retrieval-reasoning scores) beats SnapKV "
                         "and Ada-SnapKV",
               "LAVa": "LAVa >= Ada-SnapKV >= SnapKV; LAVa vs CAKE",
               "CriticalKV": "the critical rule beats its base method at every budget",
               "D2O": "D2O > H2O > StreamingLLM; merging helps",
               "SlimInfer": "SlimInfer keeps full's accuracy (within 5 points) and beats LazyLLM",
               "ASL": "ASL beats FastKV and GemFilter at equal KV"}
# a paper's "no worse than full" rows where its own claim is an ordering
NO_WORSE_WORDS = {"AdaKV": "Ada-SnapKV and Ada-PyramidKV keep full's accuracy (within 5 points)",
                  "PyramidKV": "PyramidKV keeps full's accuracy (within 5 points)",
                  "LAVa": "LAVa and CAKE keep full's accuracy (within 5 points)",
                  "CriticalKV": "the critical rule keeps full's accuracy (within 5 points)",
                  "D2O": "D2O keeps full's accuracy (within 5 points)"}
DEV_SEED = 1
DEV_KERNELS = (5, 7, 11, 17, 21)


@functools.cache
def dev_kernel() -> tuple[int | None, str]:
    """SnapKV's pooling kernel chosen on the dev seed: the best mean accuracy of SnapKV and
    Ada-SnapKV at 1/16 and 1/8 of 1024 on seed-1 prompts (dev_s1_pool_max_k*_1024.jsonl),
    the smaller kernel on a tie; (None, why) until every kernel's sweep is complete."""
    means = {}
    for k in DEV_KERNELS:
        f = RECORDS / f"dev_s1_pool_max_k{k}_1024.jsonl"
        recs = [r for r in report.load_records(f) if r["samples"] >= 50] if f.exists() else []
        if len(recs) < 4 or any(r["seed"] != DEV_SEED for r in recs):
            return None, f"the dev sweep of kernel {k} is not complete"
        means[k] = sum(r["accuracy"] for r in recs) / len(recs)
    best = max(means, key=lambda k: (means[k], -k))
    return best, ", ".join(f"kernel {k}: {100 * m:.0f}%" for k, m in means.items())


# the kernel every SnapKV-family claim reads, 17, was first chosen on the seed-0 prompts
# (pooling.md); it counts as tuned on the dev seed only where the dev seed chooses it too
TUNED = {"kernel": 17}
REGISTRY: list[dict] = []  # every comparison the pages read, in page order
TABLES: list[list[int]] = []  # each rendered claims table: its rows' indices in REGISTRY
PAGE = {"name": "baselines"}  # the page being rendered (its paper)


def _nondefault(r: dict) -> dict:
    import dataclasses
    import json

    from kvjax import methods

    if r["method"] == "full":
        return {}
    # through JSON, as the records hold them (tuples become lists)
    default = json.loads(json.dumps(params({"method_params": dataclasses.asdict(
        methods.create(r["method"]))})))
    # a budget replaces LazyLLM's keep_ratio (`with_budget`): the budget says it
    return {k: v for k, v in params(r).items()
            if k not in ("budget", "select_k") and default.get(k) != v
            and not (k == "keep_ratio" and r.get("budget") is not None)}


def _tuned_on(x: dict, y: dict):
    """Where a non-default kernel of either arm was chosen: SmolLM2's on the dev seed (or
    seed 0, the seed judged), Qwen's on RULER's dev samples; None at the default."""
    kernels = {_nondefault(r).get("kernel") for r in (x, y)} - {None}
    if not kernels:
        return None
    if x["model"].startswith("qwen"):
        return f"RULER samples {QWEN_DEV_SKIP}-{QWEN_DEV_SKIP + 49}" \
            if kernels == {qwen_dev_kernel()[0]} else 0
    if kernels != {TUNED["kernel"]}:
        return None
    return DEV_SEED if dev_kernel()[0] == TUNED["kernel"] else 0


def _register(ra: list[dict], rb: list[dict], part: str, scenario: str) -> int:
    """A comparison's registry row (its statistics; Holm and the verdict come in `main`);
    the same comparison read on two pages is one row."""
    from kvjax import claims as cl

    x, y = ra[0], rb[0]
    a, b = cl.spec(x["method"], _nondefault(x)), cl.spec(y["method"], _nondefault(y))
    if x["scenario"] != y["scenario"]:  # one method in two scenarios
        a, b = f"{a} {x['scenario']}", f"{b} {y['scenario']}"
    paper = PAPER_OF_METHOD.get(x["method"], PAPER[PAGE["name"]]) if PAGE["name"] == "baselines" \
        else PAPER[PAGE["name"]]
    kind = "no worse" if y["method"] == "full" else "better"
    files = sorted({f for r in ra + rb for f in r["_files"]})
    words = NO_WORSE_WORDS.get(paper, CLAIM_WORDS[paper]) if kind == "no worse" \
        else CLAIM_WORDS[paper]
    row = {"paper": paper, "claim": words, "model": x["model"],
           "task": "+".join(dict.fromkeys(r["task"] for r in ra)),
           "context": x["context_length"], "scenario": scenario, "budget": part,
           "a": a, "b": b, "kind": kind, "margin": cl.MARGIN if kind == "no worse" else None,
           "records": files, "a_records": [cl.record_key(r) for r in ra],
           "b_records": [cl.record_key(r) for r in rb], "seed": x["seed"],
           "tuned_on": _tuned_on(x, y),
           "page": f"docs/results/{PAGE['name']}.md"}
    # records are keyed by method, budget, task and samples, not by model: the model too,
    # or the 1.5B's comparison would be read as the 0.5B's of the same samples
    same = [i for i, o in enumerate(REGISTRY) if (o["model"], o["a_records"], o["b_records"])
            == (row["model"], row["a_records"], row["b_records"])]
    if same:  # found before its statistics are computed again
        return same[0]
    a_s, b_s = cl.scores_of(ra, rb)
    binary = cl.is_binary(a_s + b_s)
    row["metric"] = "accuracy" if binary else "score"
    row.update(cl.compare(a_s, b_s, binary))
    REGISTRY.append(row)
    return len(REGISTRY) - 1


def _register_units(ra: list[dict], rb: list[dict], metric: str, a: str, b: str, task: str,
                    context: int, scenario: str, part: str, files: list[str],
                    arms: tuple = (None, None)) -> int:
    """A registry row whose units are text blocks (metric `nll`) or samples' summed output
    perturbations (`perturbation`), lower better in both: `kvjax.claims.units`; the model
    the records name (Holm is over a paper's comparisons on one model)."""
    from kvjax import claims as cl

    (model,) = {r["model"] for r in ra + rb}
    row = {"paper": PAPER[PAGE["name"]], "claim": CLAIM_WORDS[PAPER[PAGE["name"]]],
           "model": model, "task": task, "context": context, "scenario": scenario,
           "budget": part, "a": a, "b": b, "kind": "better", "margin": None,
           "records": files, "a_records": [cl.record_key(r, metric) for r in ra],
           "b_records": [cl.record_key(r, metric) for r in rb], "seed": ra[0].get("seed"),
           "tuned_on": None, "page": f"docs/results/{PAGE['name']}.md", "metric": metric}
    if arms != (None, None):
        row["a_arm"], row["b_arm"] = arms
    row.update(cl.compare(cl.units(ra, metric, arms[0]), cl.units(rb, metric, arms[1]),
                          binary=False))
    REGISTRY.append(row)
    return len(REGISTRY) - 1


def claims(recs: list[dict], pairs, at, scenario: str = "question_aware") -> str:
    """The paired comparisons "a vs b" at each (budget, name) of `at` for each (a, b, params
    of a, params of b); `at` = (None,): the methods' own defaults (full's record for b =
    full). Returns a placeholder that `main` fills with the table once every page's
    comparisons are known (Holm is over a paper's comparisons on the model)."""
    from kvjax.claims import spec

    ids, missing = [], []
    for b, part in (((None, "their defaults"),) if at == (None,) else at):
        for x, y, px, py in pairs:
            rx = (next((r for r in recs if r["method"] == x), None) if b is None
                  else find(recs, x, b, scenario, **px))
            ry = find(recs, y, b, scenario, **py)
            if rx and ry:
                ids.append(_register(rx.get("_parts", [rx]), ry.get("_parts", [ry]), part,
                                     scenario))
            else:  # said, so that a declared comparison never vanishes from its page
                missing.append([spec(m, pm) for m, pm, r in ((x, px, rx), (y, py, ry)) if not r])
    TABLES.append(ids)
    table = f"@@claims-table-{len(TABLES) - 1}@@" if ids else ""
    if missing:
        arms = ", ".join(sorted({a for m in missing for a in m}))
        table += (("\n\n" if ids else "") + f"Declared, not measured here: {len(missing)} "
                  f"comparison{'s' * (len(missing) > 1)}, no records of {arms} at these budgets.")
    return table


def claims_table(rows: list[dict]) -> str:
    """A page's claims table from registry rows (judged)."""
    if rows and rows[0]["metric"] in ("nll", "perturbation"):  # lower better: shown as is
        what = {"nll": "mean NLL a token", "perturbation": "sum over layers"}[rows[0]["metric"]]
        unit = {"nll": "blocks", "perturbation": "samples"}[rows[0]["metric"]]
        lines = [f"| claim | a: {what} | b | {unit} a lower : b lower | a - b [95% bootstrap] "
                 "| p (Holm) | verdict | why | claims.jsonl |", "|---" * 9 + "|"]
        for r in rows:
            lines.append(
                f"| {r['a']} below {r['b']} at {r['budget']} | {-r['a_acc']:.4g} | "
                f"{-r['b_acc']:.4g} | {r['a_wins']} : {r['b_wins']} | "
                f"{r['b_acc'] - r['a_acc']:+.3g} [{-r['diff_hi']:+.3g}, {-r['diff_lo']:+.3g}] | "
                f"{r['p']:.2g} ({r['p_holm']:.2g}) | {r['verdict']} | {r['reason']} | "
                f"#{r['id']} |")
        return "\n".join(lines)
    lines = ["| claim | a % | b % | a wins : b wins | p (Holm) | verdict | why | claims.jsonl |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = ">" if r["kind"] == "better" else f">= (-{round(100 * r['margin'])} pts)"
        lines.append(f"| {r['a']} {rel} {r['b']} at {r['budget']} | {100 * r['a_acc']:.0f} | "
                     f"{100 * r['b_acc']:.0f} | {r['a_wins']} : {r['b_wins']} | "
                     f"{r['p']:.2g} ({r['p_holm']:.2g}) | {r['verdict']} | {r['reason']} | "
                     f"#{r['id']} |")
    return "\n".join(lines)


def intro(ctx: int, recs: list[dict], files: str, extra: str = "", task: str = TASK,
          scenario: str = "question-aware") -> str:
    full = scored(find(recs, "full"))
    (b8, _), (b16, _) = budgets(ctx)
    return (f"{task}, plain prompts, {ctx} tokens, {scenario}, 50 samples a cell, "
            f"seed 0; {report.model_line(recs)}. Full cache: {fmt(full)}. Budgets are "
            f"entries per layer and KV head ({b8} = 1/8, {b16} = 1/16), methods at their "
            "papers' defaults unless a kernel is named (docs/results/pooling.md)."
            f"{extra} Where one full prefill per batch of 8 served every method that "
            "compresses after it (`prefill: shared` in the records), TTFT is that prefill "
            "plus the method's own compression (in brackets); TTFT and TPOT are the "
            "sweep's wall times on a 2-core machine that sometimes ran other work: compare "
            "them within one records file, not across files. Rendered by `python "
            f"scripts/smollm2_results.py` from docs/results/smollm2/{files}; the sweeps: "
            f"`scripts/sweeps_smollm2.sh` (these records: {_minutes_text(recs)}, "
            f"summed from their own TTFT, TPOT x steps and compile times). The "
            "claims are "
            "judged paired on the same prompts (`a wins : b wins`: the samples only one of "
            "the two answers; exact McNemar, Holm over the paper's comparisons on this "
            "model; the rules and the verdicts' meaning: docs/results/README.md; each row "
            "is the line of docs/results/claims.jsonl with its id).")


def _sweep_minutes(recs: list[dict], batch: int = 8) -> tuple[float, bool]:
    """What the sweeps behind `recs` cost, from the records' own clocks, and whether that is
    exact: per batch (the record's `batches`, else `batch` a batch), each method's TTFT (its
    own compression where the prefill was shared, plus that shared prefill once per group of
    jobs that shared it), TPOT x the steps run (`steps_run`; records from before it count
    max_new_tokens a batch, an upper bound: a niah answer stops after ~10 of RULER's 128
    tokens), plus each record's compile time."""
    import math

    total, shared, exact = 0.0, {}, True
    for r in recs:
        n = r.get("batches") or math.ceil(r["samples"] / batch)
        own = r["ttft_own_s"] if r.get("prefill") == "shared" else r["ttft_s"]
        steps = r.get("steps_run")
        exact &= steps is not None or not r["max_new_tokens"]
        steps = n * (r["max_new_tokens"] or 0) if steps is None else steps
        total += n * own + steps * (r["tpot_s"] or 0)
        total += r.get("compile_s") or 0
        if r.get("prefill") == "shared":
            # one group's jobs carry the same measured prefill time: it names the group
            prefill = r["ttft_s"] - r["ttft_own_s"]
            shared[r["task"], r["context_length"], n, round(prefill, 2)] = n * prefill
    return (total + sum(shared.values())) / 60, exact


def _minutes_text(recs: list[dict], where: str = "on 2 cores") -> str:
    """`_sweep_minutes` as the pages say it (`where`: the machine and clock): `at most`,
    with why, only where a record holds no step count."""
    minutes, exact = _sweep_minutes(recs)
    return (f"{minutes:.0f} min {where}" if exact else f"at most {minutes:.0f} min {where}: "
            "decoding counted at max_new_tokens, where records hold no step count")


def _base_files(ctx: int) -> str:
    return " and ".join(f"{n}_{ctx}.jsonl" for n in BASE[ctx])


PYRAMID = (" PyramidKV at its default beta 20 falls back to SnapKV whenever the budget is "
           "below 20 x its 32-token window (kvpress's rule; docs/methods.md): at these "
           "budgets it keeps SnapKV's entries, and its rows equal SnapKV's.")


BASELINES = {"snapkv", "ada_snapkv", "pyramidkv", "ada_pyramidkv", "observed_attention", "headkv"}


def _arm(r: dict) -> tuple:
    """What makes a record one arm of a page: method, scenario, budget, kernel."""
    return r["method"], r["scenario"], r["budget"], params(r).get("kernel")


def baselines(ctx: int, task: str = TASK) -> str | None:
    if task == TASK:
        recs = records_at(ctx, *BASE[ctx])
        files = _base_files(ctx)
    else:  # passkey at 1024
        recs = records_at(ctx, task, f"{task}_k17", task=task)
        files = f"{task}_{ctx}.jsonl and {task}_k17_{ctx}.jsonl"
    if not {"snapkv", "full"} <= {r["method"] for r in recs}:  # a sweep still under way
        return None
    # the baselines first measured in the gaps sweeps (and PyramidKV at 17 beside LAVa)
    pre = "" if task == TASK else f"{task}_"
    for name in (f"{pre}gaps", f"{pre}gaps_k17", "headkv_k17", "lava_k17"):
        have = {_arm(r) for r in recs}
        more = [r for r in records_at(ctx, name, task=task)
                if r["method"] in BASELINES and _arm(r) not in have]
        if more:
            recs, files = recs + more, f"{files} and {name}_{ctx}.jsonl"
    pairs = [("snapkv", o, k, {}) for k in ({"kernel": 7}, K17)
             for o in ("h2o", "tova", "streaming_llm")]
    pairs += [(o, "snapkv", k, k) for k in ({"kernel": 7}, K17)
              for o in ("ada_snapkv", "pyramidkv")]
    pairs += [("ada_pyramidkv", "pyramidkv", K17, K17), ("observed_attention", "full", {}, {}),
              ("headkv", "snapkv", K17, K17), ("headkv", "ada_snapkv", K17, K17)]
    return (intro(ctx, recs, files, PYRAMID if any(r["method"] == "pyramidkv" for r in recs)
                  else "", task=task)
            + "\n\n" + table(recs) + "\n\n" + claims(recs, pairs, budgets(ctx)))


QWEN = ROOT / "docs" / "results" / "qwen2.5-coder-0.5b"
# scripts/sweeps_qwen.sh's declared comparisons: every method no worse than full, and the
# baselines' orderings, at each budget and task
QWEN_METHODS = ("snapkv", "ada_snapkv", "pyramidkv", "ada_pyramidkv", "h2o", "tova",
                "streaming_llm")
QWEN_PAIRS = ([(m, "full") for m in QWEN_METHODS]
              + [("ada_snapkv", "snapkv"), ("ada_pyramidkv", "pyramidkv"), ("pyramidkv", "snapkv")]
              + [("snapkv", o) for o in ("h2o", "tova", "streaming_llm")]
              + [("observed_attention", "full")])  # from the papers sweep
# HeadKV's, at the kernel the papers sweep ran it (`qwen_baselines`)
QWEN_HEADKV = [("headkv", "full"), ("headkv", "snapkv"), ("headkv", "ada_snapkv")]


def _baseline_kernel(ctx: int) -> int | None:
    """The SnapKV family's kernel in the baselines sweep at `ctx`: its default 7 at the
    first length (as it ran), the dev-chosen one at longer ones (scripts/sweeps_qwen.sh)."""
    return 7 if ctx == QWEN_CONTEXTS[0] else qwen_dev_kernel()[0]


def _qwen_pairs(ctx: int = 4096) -> list[tuple]:
    """QWEN_PAIRS with the SnapKV family at the baselines sweep's kernel at `ctx`
    (`_baseline_kernel`), and HeadKV's comparisons at the kernel the papers sweep ran
    (`qwen_dev_kernel`)."""
    kb = _baseline_kernel(ctx)
    at_kb = lambda m: {"kernel": kb} if m in KERNELED else {}  # noqa: E731
    pairs = [(a, b, at_kb(a), at_kb(b)) for a, b in QWEN_PAIRS]
    k = qwen_dev_kernel()[0]
    if k is not None:
        at = lambda m: {"kernel": k} if m in KERNELED else {}  # noqa: E731
        pairs += [(a, b, at(a), at(b)) for a, b in QWEN_HEADKV]
    return pairs


def _under_way(pattern: str, folder=None) -> list[str]:
    """How far each unfinished Qwen sweep matching `pattern` (its .batches file, in `folder`:
    QWEN's by default) is."""
    import json

    going = []
    for f in sorted((folder or QWEN).glob(pattern)):
        jobs = {}
        for line in f.read_text().splitlines():
            try:  # a line cut off by a kill is skipped, as `--resume` skips it
                piece = json.loads(line)
            except ValueError:
                continue
            jobs.setdefault(piece["job"], set()).update(piece["idx"])
        done = min(len(v) for v in jobs.values())
        cells = "1 cell has" if len(jobs) == 1 else f"{len(jobs)} cells have"
        going.append(f"`{f.name[:-len('.batches')]}` (under way: {cells} begun, the least "
                     f"advanced at {done} of 50 samples)")
    return going


def _resumes(going: list[str], section: str, env: str = "") -> str:
    """The unfinished sweeps and the command that resumes them."""
    return f"{'; '.join(going)} (`{env}nice bash scripts/sweeps_qwen.sh {section}` resumes it)."


def _cell(r: dict) -> tuple:
    """What makes two records of the same samples the same cell."""
    return r["method"], r["budget"], r["scenario"], params(r).get("kernel")


def _joined(sources) -> list[dict]:
    """The complete cells (n >= 50) of records files of the same samples, each with its
    file: `sources` are (path, keep) in order of precedence, and a cell an earlier file has
    (`_cell`) is not taken again from a later one; a file that does not exist gives none."""
    recs, seen = [], set()
    for path, keep in sources:
        if path.exists():
            rel = str(path.relative_to(ROOT))
            mine = [{**r, "_files": [rel]} for r in report.load_records(path)
                    if r["samples"] >= 50 and keep(r) and _cell(r) not in seen]
            recs += mine
            seen |= {_cell(r) for r in mine}
    return recs


def _own_and_full(f, prefix: str, keep=lambda r: True,
                  from_base: tuple[str, ...] = ()) -> tuple[list[dict], object]:
    """The complete cells of a Qwen sweep's records `<prefix>_<task>_<ctx>.jsonl` that
    `keep` passes, and full (and the `from_base` methods that `keep` passes) from the
    baselines sweep of the same samples where the file has none; and that baselines file."""
    base = f.with_name("baselines_" + f.name[len(prefix) + 1:])
    return _joined([(f, keep), (base, lambda r: r["method"] == "full" or (
        r["method"] in from_base and keep(r)))]), base


# Qwen2.5-Coder-1.5B (`MODEL=qwen2.5-coder-1.5b bash scripts/sweeps_qwen.sh key`): each
# paper's key comparison at 1/8 of 4096, one shared prefill; the kernel methods at the 0.5B's
# dev-chosen kernel, PyramidKV at its default 7, which at this budget is SnapKV's rule (its
# fallback below 20 windows) at kernel 7: so PyramidKV is compared with full only, and its
# cell against SnapKV's is the pooling kernel's effect on this model (`_kernel_probe`)
QWEN15 = ROOT / "docs" / "results" / "qwen2.5-coder-1.5b"
QWEN15_PAIRS = {
    "baselines": [(m, "full") for m in ("snapkv", "ada_snapkv", "pyramidkv", "h2o",
                                        "streaming_llm")]
    + [("ada_snapkv", "snapkv"), ("snapkv", "h2o"), ("snapkv", "streaming_llm")],
    "lava": [("lava", "full"), ("lava", "ada_snapkv"), ("lava", "snapkv"),
             ("ada_snapkv", "snapkv")],
    "criticalkv": [("critical_snapkv", "full"), ("critical_snapkv", "snapkv")],
    "d2o": [("d2o", "full"), ("d2o", "h2o"), ("d2o", "streaming_llm")],
}


def _qwen15_want(m: str) -> dict:
    """The parameters the 1.5B's records are read at (scripts/sweeps_qwen.sh key)."""
    return {"kernel": 7} if m == "pyramidkv" else _at_qwen_kernel(m)


def _kernel_probe(ctx: int) -> str:
    """SnapKV at kernel 7 (PyramidKV's cell of the key sweep) against SnapKV at the dev
    kernel, paired: does the needle-span failure of kernel 7 remain on the larger model?"""
    from kvjax import claims as cl

    out = []
    k = qwen_dev_kernel()[0]
    for f in sorted(QWEN15.glob(f"key_*_{ctx}.jsonl")):
        recs, _ = _own_and_full(f, "key")
        lo = find(recs, "pyramidkv", ctx // 8, kernel=7)
        hi = find(recs, "snapkv", ctx // 8, kernel=k)
        if lo is None or hi is None:
            continue
        a, b = cl.scores_of([hi], [lo])
        wins = sum(x > y for x, y in zip(a, b)), sum(y > x for x, y in zip(a, b))
        out.append(f"The pooling kernel on this model ({hi['task']}): SnapKV at kernel {k} "
                   f"{fmt(scored(hi))}, at kernel 7 (PyramidKV's cell: at {ctx // 8} of {ctx} its "
                   f"schedule falls back to SnapKV's rule) {fmt(scored(lo))}; paired, kernel "
                   f"{k} right where 7 is wrong on {wins[0]} samples, the reverse on {wins[1]} "
                   "(not a claim of a paper: the kernel is the 0.5B's dev choice).")
    return "\n\n".join(out)


def qwen15(page: str, ctx: int = 4096) -> str:
    """A page's section on Qwen2.5-Coder-1.5B: per task of the `key` sweep, the page's
    methods and its declared comparisons (QWEN15_PAIRS) at 1/8; what is not run, said."""
    if page not in QWEN15_PAIRS:
        return (f"Not in this model's plan: {page} runs its own prefill, ~2.5 h a method at "
                f"n = 50 on 2 cores (scripts/sweeps_qwen.sh, its header).")
    k = qwen_dev_kernel()[0]
    blocks = _qwen_blocks("key", QWEN15_PAIRS[page], budgets(ctx)[:1],
                          f"1/8 of the context; SnapKV, Ada-SnapKV, LAVa and CriticalKV at "
                          f"kernel {k} (the 0.5B's dev choice), PyramidKV at its default 7",
                          "key", ctx, _qwen15_want, folder=QWEN15,
                          plot=page if page in ("lava", "d2o") else None)
    if blocks and page == "baselines":
        blocks += [b for b in [_kernel_probe(ctx)] if b]
    if blocks:
        return "\n\n".join(blocks)
    run = ("`MODEL=qwen2.5-coder-1.5b nice bash scripts/sweeps_qwen.sh key` on the tasks it "
           "solves (plan and cost: the script's header)")
    if any(QWEN15.glob(f"ruler_{ctx}*.jsonl")):
        return (f"Not measured yet: the full cache's calibration is in MODEL.md "
                f"(`qwen2.5-coder-1.5b-ruler`); next {run}.")
    return ("Not measured yet: the full cache's calibration on RULER's samples 0-7 "
            f"(`MODEL=qwen2.5-coder-1.5b nice bash scripts/sweeps_qwen.sh calibrate`), then {run}.")


QWEN_CONTEXTS = (4096, 8192)  # `CTX=8192 bash scripts/sweeps_qwen.sh baselines` for the second


def qwen_baselines() -> str:
    """Qwen2.5-Coder-0.5B's baselines at each of QWEN_CONTEXTS on each RULER task its full
    cache solves there (`scripts/sweeps_qwen.sh baselines`): a table and the declared
    comparisons per task whose sweep is complete; a sweep under way says how far it is."""
    blocks = [b for ctx in QWEN_CONTEXTS for b in _qwen_baseline_blocks(ctx)]
    blocks += qwen_task_kernel("baselines")  # HeadKV at a task's own dev kernel
    going = [g for ctx in QWEN_CONTEXTS for g in _under_way(f"baselines_*_{ctx}.jsonl.batches")]
    # the first length always (the plan's), the others once a sweep at them exists
    at = [c for i, c in enumerate(QWEN_CONTEXTS)
          if i == 0 or any(QWEN.glob(f"baselines_*_{c}.jsonl*"))]
    head = ("The eight baselines at 1/8 and 1/16 of the context on the RULER tasks "
            f"Qwen2.5-Coder-0.5B's full cache solves at {' and '.join(map(str, at))} (MODEL.md, "
            "`qwen2.5-coder-0.5b-ruler`), SnapKV's pooling kernel at its default 7 at 4096 and at "
            "the dev-chosen kernel at longer contexts (7 left the family at the floor at 4096), "
            "methods otherwise at their papers' defaults. Rendered by `python scripts/smollm2_results.py` from "
            "the records of `scripts/sweeps_qwen.sh baselines` (ObservedAttention, the ninth, HeadKV "
            "and the SnapKV family at the dev-chosen kernel from the `papers` and `aggregation` "
            "sweeps where they ran, on the same samples).")
    if going:
        head += " Sweeps not finished: " + "; ".join(going) + "."
    if not blocks:
        head += " No task's sweep is complete yet."
    return "\n\n".join([head, *blocks])


def _qwen_baseline_blocks(ctx: int) -> list[str]:
    blocks = []
    for f in sorted(QWEN.glob(f"baselines_*_{ctx}.jsonl")):
        rel = str(f.relative_to(ROOT))
        # the baselines measured beside the papers' methods on the same samples (the papers
        # sweep, LAVa's aggregation sweep): ObservedAttention, HeadKV, the SnapKV family at
        # the dev-chosen kernel
        beside = [g for g in (f.with_name(f.name.replace("baselines_", side, 1))
                              for side in ("papers_", "lava_")) if g.exists()]
        recs = _joined([(f, lambda r: True)] + [(g, lambda r: r["method"] in (
            "observed_attention", "headkv") or (r["method"] in ("snapkv", "ada_snapkv")
                                                and params(r).get("kernel") != 7))
            for g in beside])
        if not {"full", "snapkv"} <= {r["method"] for r in recs if r["_files"] == [rel]}:
            continue
        task = recs[0]["task"]
        full = scored(find(recs, "full"))
        skip = recs[0].get("ruler_skip", 0)
        blocks.append(
            f"#### {task}{f' at {ctx}' if ctx != QWEN_CONTEXTS[0] else ''}\n\n"
            f"RULER's samples {skip}-{skip + recs[0]['samples'] - 1} "
            f"(`--ruler-skip {skip}`: the calibration chose the task on samples 0-15), "
            f"plain prompts, {ctx} tokens, question-aware, "
            f"seed {recs[0]['seed']}; {report.model_line(recs)}. Full cache: {fmt(full)}. Records: `{rel}` "
            f"({_minutes_text(recs, 'on 2 cores by their own clocks')})"
            + "".join(f"; beside the papers' methods: " + " and ".join(used)
                      for used in [[f"`{g.relative_to(ROOT)}`" for g in beside
                                    if any(str(g.relative_to(ROOT)) in r["_files"]
                                           for r in recs)]] if used)
            + f"; the declared comparisons read the SnapKV family at kernel "
              f"{_baseline_kernel(ctx)}"
            + (f" (HeadKV's, both sides at {qwen_dev_kernel()[0]}, as the papers sweep ran it)"
               if qwen_dev_kernel()[0] != _baseline_kernel(ctx) else "") + ".\n\n"
            + table(recs) + "\n\n" + claims(recs, _qwen_pairs(ctx), budgets(ctx)))
    return blocks


# The pooling kernel on Qwen2.5-Coder-0.5B (`scripts/sweeps_qwen.sh pooling`): chosen on RULER
# samples 66-115 (dev), never on the 16-65 every Qwen claim is judged on
QWEN_DEV_SKIP = 66
QWEN_KERNELS = (7, 17)


@functools.cache
def qwen_dev_kernel(task: str = "niah_multikey_2", ctx: int = 4096) -> tuple[int | None, str,
                                                                             list[dict]]:
    """SnapKV's kernel for the Qwen claims: the best mean accuracy of SnapKV and Ada-SnapKV
    at 1/8 and 1/16 on the dev samples, 7 (the default) unless another does better; (None,
    why, records) until every kernel's sweep is complete."""
    means, recs = {}, []
    for k in QWEN_KERNELS:
        f = QWEN / f"dev_pool_k{k}_{task}_{ctx}.jsonl"
        got = [r for r in report.load_records(f) if r["samples"] >= 50] if f.exists() else []
        if len(got) < 4 or any(r.get("ruler_skip") != QWEN_DEV_SKIP for r in got):
            return None, f"the dev sweep of kernel {k} is not complete", recs
        recs += [{**r, "_files": [str(f.relative_to(ROOT))]} for r in got]
        means[k] = sum(r["accuracy"] for r in got) / len(got)
    best = max(means, key=lambda k: (means[k], k == 7, -k))
    return best, ", ".join(f"kernel {k}: {100 * m:.0f}%" for k, m in means.items()), recs


def qwen_pooling(task: str = "niah_multikey_2", ctx: int = 4096) -> str:
    k, why, recs = qwen_dev_kernel(task, ctx)
    if k is None:
        return (f"Not measured yet ({why}): `nice bash scripts/sweeps_qwen.sh pooling "
                f"ruler/{task}`.")
    lines = [f"| method | kernel | @{ctx // 16} (1/16) | @{ctx // 8} (1/8) |", "|---|---|---|---|"]
    for m in ("snapkv", "ada_snapkv"):
        for kk in QWEN_KERNELS:
            cells = [scored(find(recs, m, b, kernel=kk)) for b in (ctx // 16, ctx // 8)]
            lines.append(f"| {m} | {kk} | " + " | ".join(fmt(c) if c else "not run"
                                                        for c in cells) + " |")
    return (f"ruler/{task}, RULER's samples {QWEN_DEV_SKIP}-{QWEN_DEV_SKIP + 49} (`--ruler-skip "
            f"{QWEN_DEV_SKIP}`: the dev samples; the claims are judged on 16-65), plain prompts, "
            f"{ctx} tokens, question-aware, max pooling, window 32; {report.model_line(recs)}. "
            "Accuracy % [95% Wilson interval]. Records: `docs/results/qwen2.5-coder-0.5b/"
            f"dev_pool_k*_{task}_{ctx}.jsonl` (`scripts/sweeps_qwen.sh pooling`).\n\n"
            + "\n".join(lines) + f"\n\nMean accuracy over the four cells: {why}. Chosen: "
            f"kernel {k}" + (" (the default; another kernel must do better to be chosen)."
                             if k == 7 else "."))


def qwen_poolings(ctx: int = 4096) -> str:
    """`qwen_pooling` of niah_multikey_2 (the kernel every Qwen claim uses), then of each
    other task with a dev pooling sweep: what that task's own dev samples would choose."""
    tasks = {f.name.split("_", 3)[3].rsplit("_", 1)[0]
             for f in QWEN.glob(f"dev_pool_k*_{ctx}.jsonl*")} - {"niah_multikey_2"}
    return "\n\n".join([qwen_pooling(ctx=ctx)] + [
        f"### ruler/{t}'s own dev samples\n\nEvery Qwen sweep runs the kernel chosen above "
        f"(on niah_multikey_2); this says which kernel {t}'s own dev samples choose (where it "
        f"differs, `scripts/sweeps_qwen.sh task_kernel` runs {t}'s kernel methods again at "
        "it).\n\n"
        + qwen_pooling(t, ctx) for t in sorted(tasks)])


# ASL's reading on Qwen (`scripts/sweeps_qwen.sh asl_dev`, declared before that run): the
# defaults (the authors' code: ranks from layer 0) if at least half the dev prompts would
# select at the paper's tau 0.3; else ranks from L_min, the reading SmolLM2's dev seed chose
ASL_QWEN_MIN_SELECT = 25


@functools.cache
def qwen_dev_asl(task: str = "niah_multikey_2", ctx: int = 4096) -> tuple[str | None, str,
                                                                          dict | None]:
    """The `--set` arguments of ASL's reading for the Qwen claims ("" for the defaults), why,
    and the dev record; (None, why, None) until the dev run is complete."""
    f = QWEN / f"dev_asl_default_{task}_{ctx}.jsonl"
    r = next((r for r in report.load_records(f) if r["method"] == "asl"
              and r["samples"] >= 50 and r.get("ruler_skip") == QWEN_DEV_SKIP), None) \
        if f.exists() else None
    if r is None:
        return None, f"{f.relative_to(ROOT)} is not complete", None
    n = int((_first_below(_relvar(r, False), 0.3) >= 0).sum())
    why = f"{n} of {r['samples']} dev prompts would select at tau 0.3 under the defaults"
    return ("" if n >= ASL_QWEN_MIN_SELECT else "--set asl.rank_from=l_min"), why, r


# scripts/sweeps_qwen.sh papers: each page's methods and declared comparisons ("a", "b"; the
# SnapKV family and LAVa/CAKE at the kernel chosen on the dev samples); H2O, StreamingLLM and
# full come from the baselines sweep on the same samples
KERNELED = {"snapkv", "ada_snapkv", "pyramidkv", "lava", "cake", "critical_snapkv",
            "critical_adakv", "headkv", "critical_headkv", "lava_heads_only", "lava_layers_only"}
QWEN_PAPER_PAIRS = {
    "lava": [("lava", "full"), ("cake", "full"), ("lava", "ada_snapkv"), ("lava", "snapkv"),
             ("lava", "pyramidkv"), ("lava", "cake"), ("ada_snapkv", "snapkv")],
    "criticalkv": [("critical_snapkv", "full"), ("critical_adakv", "full"),
                   ("critical_headkv", "full"), ("critical_snapkv", "snapkv"),
                   ("critical_adakv", "ada_snapkv"), ("critical_headkv", "headkv")],
    "d2o": [("d2o", "full"), ("d2o", "h2o"), ("d2o", "streaming_llm")],
}


def _at_qwen_kernel(m: str) -> dict:
    """The parameters a method's Qwen records are read at: the dev-chosen kernel where it
    has one."""
    return {"kernel": qwen_dev_kernel()[0]} if m in KERNELED else {}


def qwen_papers(page: str) -> str | None:
    """A page's comparisons on Qwen2.5-Coder-0.5B from `scripts/sweeps_qwen.sh papers` and
    the baselines sweep of the same task, at each context; None before any papers sweep is
    complete."""
    blocks = [b for ctx in QWEN_CONTEXTS for b in _qwen_paper_blocks(page, ctx)]
    going = " ".join(
        _resumes(g, "papers ruler/niah_multikey_2",
                 "" if ctx == QWEN_CONTEXTS[0] else f"CTX={ctx} BATCH=8 ")
        for ctx in QWEN_CONTEXTS for g in [_under_way(f"papers_*_{ctx}.jsonl.batches")] if g)
    more = qwen_more(page)
    if not blocks:
        return "Not measured yet: " + going if going else None
    return ("The papers' methods on the RULER tasks Qwen2.5-Coder-0.5B's full cache solves, "
            "at 1/8 and 1/16 of the context, rendered by `python "
            "scripts/smollm2_results.py` from `scripts/sweeps_qwen.sh papers`."
            + (" Not finished: " + going if going else "") + "\n\n"
            + "\n\n".join(blocks + more))


def _qwen_paper_blocks(page: str, ctx: int) -> list[str]:
    """A block per complete `papers_<task>_<ctx>.jsonl`: the page's methods, with full, H2O,
    StreamingLLM (and at longer contexts the SnapKV family) from the baselines sweep of the
    same samples, and LAVa, CAKE and the SnapKV family from the aggregation sweep where it
    ran the task."""
    k = qwen_dev_kernel()[0]
    want = _at_qwen_kernel
    pairs = [(a, b, want(a), want(b)) for a, b in QWEN_PAPER_PAIRS[page]]
    shown = {m for ab in QWEN_PAPER_PAIRS[page] for m in ab}
    blocks = []
    for f in sorted(QWEN.glob(f"papers_*_{ctx}.jsonl")):
        base = f.with_name(f.name.replace("papers_", "baselines_", 1))
        # where the aggregation sweep ran this task (same samples), LAVa, CAKE and the
        # SnapKV family at the chosen kernel are its cells: the papers sweep skips them.
        # Full from there too: the same comparison of LAVa with full is then one registry
        # row on both blocks (a row's records name one full record: `claims.find`)
        agg = f.with_name(f.name.replace("papers_", "lava_", 1))
        if agg.exists() and page == "lava":
            continue  # the aggregation block (qwen_more) shows LAVa's comparisons there
        recs = _joined([(g, lambda r: True) for g in (f, agg, base)])
        if k is None or not {"full", "lava", "d2o"} <= {r["method"] for r in recs}:
            continue
        mine = [r for r in recs if r["method"] in shown
                and all(params(r).get(kk) == v for kk, v in want(r["method"]).items())]
        skip = recs[0].get("ruler_skip", 0)
        blocks.append(
            f"#### {recs[0]['task']}{f' at {ctx}' if ctx != QWEN_CONTEXTS[0] else ''}\n\n"
            f"RULER's samples {skip}-{skip + 49}, plain prompts, "
            f"{ctx} tokens, question-aware, seed {recs[0]['seed']}; {report.model_line(recs)}; "
            f"pooling kernel {k} where a method has one (chosen on RULER's samples "
            f"{QWEN_DEV_SKIP}-{QWEN_DEV_SKIP + 49}: pooling.md). Records: "
            f"`{f.relative_to(ROOT)}`"
            + (f", for full, LAVa, CAKE and the SnapKV family `{agg.relative_to(ROOT)}` (the "
               "aggregation sweep's cells)" if agg.exists() else "")
            + f" and, for {'' if agg.exists() else 'full, '}H2O and StreamingLLM (and the "
            f"SnapKV family at kernel {_baseline_kernel(ctx)}), `{base.relative_to(ROOT)}`.\n\n"
            + table(mine) + "\n\n" + claims(mine, pairs, budgets(ctx))
            + (_qwen_layer_plot(mine, page, ctx, budgets(ctx)) if page != "criticalkv" else ""))
    return blocks


QWEN_TITLES = {"qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B", "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B"}


def _qwen_layer_plot(recs: list[dict], page: str, ctx: int, at, suffix: str = "") -> str:
    """A Qwen block's layer budgets (`_layer_plot`): LAVa's and CAKE's entries a layer
    summed over the model's 2 KV heads (both Qwen models have 2), D2O's (Eq. 13) a head's;
    the file named by the records' model."""
    key, heads, methods = (("layer_sizes", 1, ("d2o", "d2o_code")) if page == "d2o" else
                           ("layer_totals", 2, ("lava", "cake")))
    model = recs[0]["model"]
    return _layer_plot(ctx, [r for r in recs if r["method"] in methods],
                       recs[0]["task"].split("/")[-1], key, page, heads, at,
                       (QWEN_TITLES.get(model, model), f"_{model}{suffix}"))


def _qwen_blocks(prefix: str, pairs, at, title: str, section: str, ctx: int = 4096,
                 want=lambda m: {}, plot: str | None = None, folder=None,
                 later=(), from_base: tuple[str, ...] = ()) -> list[str]:
    """A block per complete `<prefix>_<task>_<ctx>.jsonl` of `scripts/sweeps_qwen.sh
    <section>` in `folder` (QWEN's by default): the table of the methods in `pairs` and the
    declared `pairs` at the budgets `at`, methods with the parameters `want(method)`, and
    the layer budgets of `plot`'s page (`_qwen_layer_plot`); full (and the `from_base`
    methods) from the file, else from the baselines sweep of the same samples; `later`
    pairs (added to a sweep after it ran) where the file has them. An unfinished sweep says
    how far it is."""
    blocks = []
    for f in sorted((folder or QWEN).glob(f"{prefix}_*_{ctx}.jsonl")):
        recs, _ = _own_and_full(f, prefix, lambda r: all(
            params(r).get(k) == v for k, v in want(r["method"]).items()), from_base)
        have = {r["method"] for r in recs}
        here = [*pairs, *(ab for ab in later if set(ab) <= have)]
        shown = {m for ab in here for m in ab}
        if not shown <= have:
            continue
        skip = recs[0].get("ruler_skip", 0)
        blocks.append(
            f"#### {recs[0]['task']}, {title}\n\nRULER's samples {skip}-{skip + 49}, plain "
            f"prompts, {ctx} tokens, {recs[0]['scenario'].replace('_', '-')}, "
            f"seed {recs[0]['seed']}; "
            f"{report.model_line(recs)}; one shared prefill; budgets "
            f"{' and '.join(f'{b} ({x})' for b, x in at)} entries a layer and KV head. "
            f"Records: " + " and ".join(sorted({f"`{g}`" for r in recs for g in r["_files"]}))
            + ".\n\n" + table(recs, shown | {"full"}, recs[0]["scenario"]) + "\n\n"
            + claims(recs, [(a, b, want(a), want(b)) for a, b in here], at,
                     recs[0]["scenario"])
            + (_qwen_layer_plot(recs, plot, ctx, at, "_" + prefix) if plot else ""))
    going = _under_way(f"{prefix}_*_{ctx}.jsonl.batches", folder)
    env = f"MODEL={folder.name} " if folder not in (None, QWEN) else ""
    return blocks + ([f"{title[0].upper() + title[1:]}: "
                      f"{_resumes(going, section, env)}"] if going else [])


# scripts/sweeps_qwen.sh d2o: D2O at the paper's own cache shares (20% and 40% of the prompt)
# with the authors' code reading and the baselines it claims to beat, one shared prefill
QWEN_D2O_PAIRS = [("d2o", "full"), ("d2o", "h2o"), ("d2o", "streaming_llm"),
                  ("d2o_code", "h2o"), ("d2o_code", "streaming_llm")]
QWEN_D2O_AT = ((1638, "40%"), (819, "20%"))  # of 4096
# and the merging baselines of D2O's Table 1, added to the sweep after it ran (2026-11-29):
# judged once their cells are in the file
QWEN_D2O_MERGE_PAIRS = [("d2o", "roco"), ("d2o", "cam")]
# scripts/sweeps_qwen.sh d2o_ablation: which of D2O's parts a loss comes from (its layer
# sizes: Table 6's "w.o. Layer Operation"; its merging), at 40%, where it left the floor;
# D2O itself re-run beside them
QWEN_D2O_ABLATION_PAIRS = [("d2o", "d2o_uniform_layers"), ("d2o", "d2o_no_merge")]

# scripts/sweeps_qwen.sh aggregation: LAVa's claim where it says dynamic layer budgets matter
# most (RULER's aggregation, scored by the share of the references written), with its
# ablations (the paper's Table 5); every method with a kernel at the Qwen kernel
QWEN_LAVA_TASK_PAIRS = QWEN_PAPER_PAIRS["lava"] + [("lava", "lava_heads_only"),
                                                   ("lava", "lava_layers_only")]


# scripts/sweeps_qwen.sh critical_co: CriticalKV in its paper's setting, context-only (the
# context compressed before the question is seen), at budgets where SmolLM2's Ada-SnapKV left
# the floor (1/2 and 2/5 of the context); kernel as chosen on the dev samples
QWEN_CRITICAL_CO_PAIRS = [("critical_snapkv", "snapkv"), ("critical_adakv", "ada_snapkv")]
QWEN_CRITICAL_CO_AT = ((2048, "1/2"), (1638, "2/5"))  # of 4096


def qwen_more(page: str, ctx: int = 4096) -> list[str]:
    """The Qwen blocks beyond the papers sweep: D2O at its own budgets, LAVa on aggregation,
    CriticalKV context-only."""
    if page == "criticalkv":
        pert = perturbation(QWEN)
        return _qwen_blocks("critical_co", QWEN_CRITICAL_CO_PAIRS, QWEN_CRITICAL_CO_AT,
                            "context-only (CriticalKV's setting)", "critical_co", ctx,
                            _at_qwen_kernel) + qwen_task_kernel(page, ctx) + (
            [f"#### Output perturbation\n\n{pert}"] if pert else [])
    if page == "d2o":
        return _qwen_blocks("d2o", QWEN_D2O_PAIRS, QWEN_D2O_AT,
                            "40% and 20% of the context (D2O's own budgets)", "d2o", ctx,
                            plot="d2o", later=QWEN_D2O_MERGE_PAIRS) + \
            _qwen_blocks("ablation_d2o", QWEN_D2O_ABLATION_PAIRS, QWEN_D2O_AT[:1],
                         "D2O's ablations at 40% of the context", "d2o_ablation", ctx) + \
            [f"#### Perplexity of a long text\n\n{ppl}" for ppl in [d2o_perplexity(QWEN)]
             if ppl]
    if page == "lava":
        return _qwen_blocks("lava", QWEN_LAVA_TASK_PAIRS, budgets(ctx),
                            "aggregation (LAVa's claim and its ablations)", "aggregation", ctx,
                            _at_qwen_kernel, plot="lava") + qwen_task_kernel(page, ctx)
    return qwen_task_kernel(page, ctx)


# scripts/sweeps_qwen.sh task_kernel: a task whose own dev samples choose another pooling
# kernel than niah_multikey_2's, which every other Qwen sweep uses (vt's choose 7: pooling.md):
# the papers' kernel methods on it again at its own kernel, the same judged samples and
# comparisons (declared 2026-11-29, before that sweep ran); the SnapKV family at 7 from the
# baselines sweep of those samples
QWEN_TASK_KERNEL_PAIRS = {"lava": QWEN_LAVA_TASK_PAIRS,
                          "criticalkv": QWEN_PAPER_PAIRS["criticalkv"],
                          "baselines": QWEN_HEADKV}


def qwen_task_kernel(page: str, ctx: int = 4096) -> list[str]:
    """A page's blocks of `scripts/sweeps_qwen.sh task_kernel` (`kernel<k>_<task>_<ctx>`)."""
    if page not in QWEN_TASK_KERNEL_PAIRS:
        return []
    return [b for k in QWEN_KERNELS for b in _qwen_blocks(
        f"kernel{k}", QWEN_TASK_KERNEL_PAIRS[page], budgets(ctx),
        f"every method at kernel {k}, the task's own dev choice (pooling.md)", "task_kernel",
        ctx, lambda m, k=k: {"kernel": k} if m in KERNELED else {},
        plot="lava" if page == "lava" else None,
        from_base=("snapkv", "ada_snapkv", "pyramidkv") if k == _baseline_kernel(ctx) else ())]


# scripts/sweeps_qwen.sh prefill: the methods that run their own prefill, each page's records
# file prefix, declared comparisons and budget (full from the baselines sweep, same samples)
QWEN_PREFILL = {
    "asl": ("prefill_asl", [("asl", "full"), ("asl", "fastkv"), ("asl", "gemfilter")],
            ((512, "1/8"),)),
    "sliminfer": ("prefill_slim", [("sliminfer", "full"), ("lazyllm", "full"),
                                   ("sliminfer", "lazyllm")],
                  ((256, "1024/512/256 tokens: the paper's schedule"),
                   (512, "2048/1024/512 tokens: twice the paper's shares"))),
}


def qwen_prefill(page: str, ctx: int = 4096) -> str | None:
    """ASL's or SlimInfer's comparisons on Qwen2.5-Coder-0.5B (`scripts/sweeps_qwen.sh
    prefill`), with whether the mechanism fired: ASL's selection layers, SlimInfer's needle
    blocks per stage and its decode swaps; None before a task's sweep is complete."""
    prefix, pairs, at = QWEN_PREFILL[page]
    shown = {m for ab in pairs for m in ab}
    blocks = []
    for f in sorted(QWEN.glob(f"{prefix}_*_{ctx}.jsonl")):
        recs, base = _own_and_full(f, prefix)
        if not shown <= {r["method"] for r in recs}:
            continue
        skip = recs[0].get("ruler_skip", 0)
        fired = ""
        if page == "asl":
            import numpy as np

            low = np.nanmin(_relvar(next(r for r in recs if r["method"] == "asl"), False),
                            axis=1)
            fired = (" ASL's selection layer: " + _asl_layers(recs) + f". Its relative rank "
                     f"variance after L_min reached {low.min():.2f} at the lowest (median over "
                     f"the prompts of each one's lowest: {np.median(low):.2f}).")
        else:
            needles = [f"at {r['budget']}, {t}" for r in recs if r["method"] == "sliminfer"
                       for t in [_needle_text(r)] if t]
            if needles:
                fired = f" SlimInfer (`answer_span` against `kept_blocks`): {'; '.join(needles)}."
        blocks.append(
            f"#### {recs[0]['task']}\n\nRULER's samples {skip}-{skip + 49}, plain prompts, "
            f"{ctx} tokens, question-aware, seed {recs[0]['seed']}; {report.model_line(recs)}; "
            f"each method its own prefill. Records: `{f.relative_to(ROOT)}` and, for full, "
            f"`{base.relative_to(ROOT)}`.{fired}\n\n" + table(recs) + "\n\n"
            + claims(recs, [(a, b, {}, {}) for a, b in pairs], at)
            + (_slim_decode(recs) if page == "sliminfer" else "")
            + (_qwen_asl_variants(f, recs, ctx) if page == "asl" else ""))
    dev = qwen_asl_dev(ctx=ctx) if page == "asl" else None
    going = _under_way(f"{prefix}_*_{ctx}.jsonl.batches")
    variants = _under_way(f"asl_variants_*_{ctx}.jsonl.batches") if page == "asl" else []
    if not blocks and not dev and not going:
        return None
    return ("The methods that change the prefill, on the RULER tasks Qwen2.5-Coder-0.5B's "
            "full cache solves at 4096, rendered by `python scripts/smollm2_results.py` from "
            "`scripts/sweeps_qwen.sh prefill`.\n\n"
            + "\n\n".join(([dev] if dev else []) + blocks
                          + ([("Under way: " if blocks else "Not judged yet: ")
                              + _resumes(going, "prefill ruler/niah_multikey_2")]
                             if going else [])
                          + ([f"Under way: {_resumes(variants, 'asl_variants')}"]
                             if variants else [])))


# scripts/sweeps_qwen.sh asl_variants: the paper's other two forms of ASL, each its own
# prefill, against what they vary (same samples, prefill_asl's records)
QWEN_ASL_VARIANT_PAIRS = [("asl_2pass", "gemfilter", {}, {}), ("asl_full_before", "asl", {}, {}),
                          ("asl", "fastkv", {}, {"tsp_rate": 0.125})]  # FastKV at ASL's KV


def _qwen_asl_variants(f, recs: list[dict], ctx: int) -> str:
    """asl_2pass (ASL's selection, then GemFilter's second pass), asl_full_before (the
    full KV up to the selection layer) and FastKV at ASL's live KV beside prefill_asl's
    records `recs` of file `f`."""
    g = f.with_name("asl_variants_" + f.name[len("prefill_asl_"):])
    if not g.exists():
        return ""
    own = [r for r in _own_and_full(g, "asl_variants")[0] if r["method"] != "full"]
    shown = {"asl_2pass", "asl_full_before"}
    if not shown <= {r["method"] for r in own}:
        return ""
    every = own + recs  # full from recs: the same baselines file
    return (f"\n\n**ASL's other forms** (`scripts/sweeps_qwen.sh asl_variants`, `{g.relative_to(ROOT)}`, "
            "the same samples, reading and kernel): asl_2pass runs the model again from "
            "layer 0 on the selected tokens (ASL + GemFilter); asl_full_before keeps the full "
            "KV up to the selection layer; FastKV with TSP rate 0.125 propagates 1/8 of the "
            "prompt, so its live KV is ASL's. Selection layers: asl_2pass "
            + _asl_layers(own, "asl_2pass") + "; asl_full_before "
            + _asl_layers(own, "asl_full_before") + ".\n\n"
            + table(every, shown | {"full", "asl", "gemfilter", "fastkv"}) + "\n\n"
            # FastKV at ASL's KV, added after the first two, is judged once its cell exists
            + claims(every, QWEN_ASL_VARIANT_PAIRS, QWEN_PREFILL["asl"][2]))


def qwen_asl_dev(task: str = "niah_multikey_2", ctx: int = 4096) -> str | None:
    """The dev run that chose ASL's Qwen reading: which prompts each tau would select and
    where (`scripts/sweeps_qwen.sh asl_dev`); None before it is complete."""
    sets, why, r = qwen_dev_asl(task, ctx)
    if sets is None:
        return None
    f = QWEN / f"dev_asl_default_{task}_{ctx}.jsonl"
    rv = _relvar(r)
    import numpy as np

    l_min = int(np.argmax(~np.isnan(rv).all(0)))
    return (f"**ASL's reading, chosen on the dev samples.** ruler/{task}, RULER's samples "
            f"{QWEN_DEV_SKIP}-{QWEN_DEV_SKIP + 49}, {ctx} tokens, ASL at its defaults (ranks "
            f"from layer 0, L_obs {r['details'][0].get('l_obs', 'default')}) with kernel "
            f"{params(r).get('kernel')} and tau = 1e-6, which never selects, so each prompt's "
            f"relative rank variance is recorded at every layer from L_min (layer {l_min} of "
            f"{rv.shape[1]}) on (`{f.relative_to(ROOT)}`). The rule, declared before the run: "
            f"the defaults if at least {ASL_QWEN_MIN_SELECT} of 50 prompts would select at "
            f"the paper's tau 0.3, else ranks from L_min (`rank_from=l_min`, SmolLM2's dev "
            f"choice). Here {why}: chosen "
            + ("the defaults." if sets == "" else f"`{sets.split()[-1].split('.', 1)[1]}`.")
            + "\n\n" + "\n".join(_tau_table([("dev, the defaults", _relvar(r, False))]))
            + _qwen_relvar_plot(r, task, ctx))


def _qwen_relvar_plot(dev: dict, task: str, ctx: int) -> str:
    """The per-layer curve on Qwen (docs/results/asl_relvar_qwen2.5-coder-0.5b.png): the dev
    run's (never selects: every layer) and the judged run's (ranks from L_min, tau 0.3: cut
    short where a prompt selected)."""
    f = QWEN / f"prefill_asl_{task}_{ctx}.jsonl"
    judged = next((r for r in report.load_records(f) if r["method"] == "asl"
                   and r["samples"] >= 50), None) if f.exists() else None
    curves = [("dev samples, the defaults, tau 1e-6", dev)] + (
        [(f"judged samples, {_asl_reading(judged)}, tau 0.3", judged)] if judged else [])
    name = "asl_relvar_qwen2.5-coder-0.5b.png"
    _relvar_png([(w, _relvar(r), _relvar(r, False)) for w, r in curves],
                f"Qwen2.5-Coder-0.5B, {task} at {ctx}", name)
    return ("\n\nThe per-layer curve (the records' `relative_variance`; the judged run's stops "
            "where a prompt selected, so its right panel is exact below tau 0.3 only):\n\n"
            f"![ASL relative rank variance on Qwen2.5-Coder-0.5B]({name})")


def _asl_reading(r: dict) -> str:
    """ASL's rank source as a record ran it."""
    return f"ranks from {'L_min' if params(r).get('rank_from') == 'l_min' else 'layer 0'}"


# LAVa's tasks at each context (the paper's claim is an average over tasks): each task's
# records files; the first is the pages' niah_single
LAVA_TASKS = {2048: ((TASK, (*BASE[2048], "lava_k17", "gaps_k17")),
                     ("niah_single_ruler", ("lava_ruler_full", "lava_ruler_k17",
                                            "lava_ruler_ablation_k17"))),
              1024: ((TASK, (*BASE[1024], "lava_k17", "gaps_k17")),
                     ("passkey", ("passkey", "passkey_k17", "lava_passkey_k17",
                                  "passkey_gaps_k17"))),
              4096: ((TASK, (*BASE[4096], "lava_k17")),)}
LAVA_PAIRS = [("lava", "ada_snapkv", K17, K17), ("ada_snapkv", "snapkv", K17, K17),
              ("lava", "snapkv", K17, K17), ("lava", "cake", K17, K17),
              # the ablations (Table 5): dynamic head and layer budgets each matter
              ("lava", "lava_heads_only", K17, K17), ("lava", "lava_layers_only", K17, K17)]
LAVA_SHOWN = {"full", "snapkv", "ada_snapkv", "pyramidkv", "lava", "cake", "lava_heads_only",
              "lava_layers_only"}


def lava(ctx: int) -> str | None:
    per_task = {}
    for task, names in LAVA_TASKS[ctx]:
        recs = [r for r in records_at(ctx, *names, task=task)
                if r["method"] == "full" or params(r).get("kernel") == 17]
        if any(r["method"] in ("lava", "cake") for r in recs):
            per_task[task] = (recs, names)
    blocks = []
    for task, (recs, names) in per_task.items():
        files = " and ".join(f"{n}_{ctx}.jsonl" for n in names)
        blocks.append(
            (f"**{task}**\n\n" if len(per_task) > 1 else "")
            + intro(ctx, recs, files, " Every method here at max pooling, kernel 17: at "
                    "kernel 7 the SnapKV family keeps no 7-token needle on this model "
                    "(docs/results/baselines.md), so no ordering can show.", task=task)
            + "\n\n" + table(recs, LAVA_SHOWN) + "\n\n"
            + claims(recs, LAVA_PAIRS, budgets(ctx)) + _layer_plot(ctx, recs, task))
    if len(per_task) > 1:
        blocks.append(f"**On average over the {len(per_task)} tasks** (the paper's claim: "
                      "its scores are averages over tasks): each method's samples of every "
                      "task pooled, one Wilson interval over them\n\n"
                      + claims(_pooled([recs for recs, _ in per_task.values()]), LAVA_PAIRS,
                               budgets(ctx)))
    return "\n\n".join(blocks) or None


def _pooled(groups: list[list[dict]]) -> list[dict]:
    """One record per (method, scenario, budget, parameters) present in every group, its
    details the groups' details concatenated: equal samples a task, so the pooled accuracy
    is the mean over tasks."""
    import json

    key = lambda r: (r["method"], r["scenario"], r["budget"] if r["method"] != "full"  # noqa: E731
                     else None, json.dumps(params(r), sort_keys=True))
    at = [{key(r): r for r in g} for g in groups]
    return [{**at[0][k], "details": [d for a in at for d in a[k]["details"]],
             "_parts": [a[k] for a in at]}
            for k in at[0] if all(k in a for a in at[1:])]


def _layer_plot(ctx: int, recs: list[dict], task: str = TASK, key: str = "layer_totals",
                page: str = "lava", heads: int = 3, at=None,
                model: tuple[str, str] = ("SmolLM2-135M", "")) -> str:
    """The entries each layer kept (mean over the samples of the details' `key`: LAVa's
    `layer_totals` are summed over the KV heads, `heads` of them, 3 on SmolLM2; D2O's
    `layer_sizes` are a head's, `heads` = 1) for the methods whose layer budgets differ, one
    panel a budget of `at` ((budget, share) pairs; `budgets(ctx)` by default):
    docs/results/<page>_layers_<task>_<ctx><model[1]>.png (when the records carry `key`:
    `slim`); `model` = (its name in the title, its suffix in the file's)."""
    have = [r for r in recs if any(key in d for d in r["details"])]
    if not have:
        return ""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from results_overview import _quantize

    what = "summed over KV heads" if heads > 1 else "a KV head"
    at = at or budgets(ctx)
    fig, axes = plt.subplots(1, len(at), figsize=(4.2 * len(at), 3.2), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, (b, part) in zip(axes, at):
        for r in sorted((r for r in have if r["budget"] == b), key=_name):
            t = np.array([d[key] for d in r["details"]], float)
            ax.plot(np.arange(t.shape[1]), t.mean(0), label=_name(r))
        ax.axhline(heads * b, color="grey", ls="--", lw=1, label="uniform")
        ax.set_title(f"budget {b} ({part}) a head", fontsize=9)
        ax.set_xlabel("layer", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"entries kept ({what})", fontsize=9)
    axes[-1].legend(fontsize=8, frameon=False)
    fig.suptitle(f"{model[0]}, {task} {ctx}: layer budgets (mean of 50 samples)",
                 fontsize=10)
    fig.tight_layout()
    path = ROOT / "docs" / "results" / f"{page}_layers_{task}_{ctx}{model[1]}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    _quantize(path)
    return (f"\n\nThe layer budgets chosen (entries kept per layer, {what}, mean over the "
            f"samples; the records' `{key}`):\n\n![layer budgets, {task} at {ctx}]({path.name})")


def criticalkv(ctx: int) -> str | None:
    recs = records_at(ctx, *BASE[ctx], "critical_k17", "critical_co_k17", "critical_co_half_k17",
                      "headkv_k17", "critical_co_headkv_k17")
    if not any(r["method"].startswith("critical_") for r in recs):
        return None
    recs = [r for r in recs if r["method"] == "full" or
            params(r).get("kernel") == 17]
    pairs = [("critical_snapkv", "snapkv", K17, K17), ("critical_adakv", "ada_snapkv", K17, K17),
             ("critical_headkv", "headkv", K17, K17)]
    shown = {"full", "snapkv", "ada_snapkv", "critical_snapkv", "critical_adakv", "headkv",
             "critical_headkv"}
    co = [r for r in recs if r["scenario"] == "context_only"]
    (b8, n8), _ = budgets(ctx)
    head = "".join(f", {n}_{ctx}.jsonl" for n, scenario in (
        ("headkv_k17", "question_aware"), ("critical_co_headkv_k17", "context_only"))
        if any(r["method"] == "headkv" and r["scenario"] == scenario for r in recs))
    half = (f", critical_co_half_k17_{ctx}.jsonl"
            if any(r["budget"] == ctx // 2 and r["scenario"] == "context_only" for r in recs)
            else "")
    out = (intro(ctx, recs, f"critical_k17_{ctx}.jsonl, critical_co_k17_{ctx}.jsonl{half}{head} "
                 f"and "
                 f"{_base_files(ctx)}",
                 " Every method here at max pooling, kernel 17 (docs/results/pooling.md); "
                 "the critical rule (CriticalKV paper, Alg. 1: half of each head's budget by "
                 "the base's attention score, the rest by that score x the value's norm "
                 "through W_O) wraps each base method.",
                 scenario="question-aware, then context-only")
           + "\n\n**Question-aware**\n\n" + table(recs, shown) + "\n\n"
           + claims(recs, pairs, budgets(ctx)))
    if co:
        at = ((ctx // 2, "1/2"), (round(0.4 * ctx), "2/5"), (2 * b8, "1/4"), (b8, n8))
        out += ("\n\n**Context-only** (the paper's setting: the question comes after "
                "compression; at 1/4 and 1/8, since at 1/8 question-aware SnapKV is already "
                "the lower bound, and where recorded at 1/2 and 2/5, where the base methods "
                "may leave the floor)\n\n" + table(co, shown, "context_only") + "\n\n"
                + claims(co, pairs, at, "context_only"))
    more = [r for r in records_at(ctx, "critical_n150_k17") if r["samples"] >= 150]
    if any(r["method"] == "critical_snapkv" for r in more):
        out += (f"\n\n**150 samples** where 50 left the critical rule's gain open (SnapKV at "
                f"1/16; docs/results/smollm2/critical_n150_k17_{ctx}.jsonl: a draw of its own, "
                "not a superset of the 50 above, since the task spreads the needle depths "
                "evenly over the sample count)\n\n" + table(more, shown) + "\n\n"
                + claims(more, pairs[:1], budgets(ctx)[1:]))
    return out


def perturbation(folder=RECORDS) -> str | None:
    """CriticalKV's output perturbation (`folder`/critical_perturb_<ctx>.jsonl): per base
    and budget, the per-sample sums over layers under both selections, their paired
    difference with a 95% t-interval over samples, and the layers where the critical form's
    mean is lower."""
    import numpy as np

    from kvjax import claims as cl

    blocks = []
    for f in sorted(folder.glob("critical_perturb_*.jsonl")):
        recs = report.load_records(f)
        if not recs:
            continue
        r0 = recs[0]
        # records since 2026-11-28 hold their run's sample count (the task spreads the
        # needle depths over it): a run cut short says how far it got
        done = len({r["sample"] for r in recs})
        short = (f" Under way: {done} of {r0['samples']} samples (the command resumes it)."
                 if done < r0.get("samples", done) else "")
        rows = ["| base | budget | queries | samples | base: sum over layers | critical | "
                "critical / base | layers lower |", "|---" * 8 + "|"]
        ids = []
        for base, budget in dict.fromkeys((r["base"], r["budget"]) for r in recs):
            rs = [r for r in recs if (r["base"], r["budget"]) == (base, budget)]
            for q in ("window", "question"):
                b = np.array([r[f"{q}_base"] for r in rs])  # [samples, L]
                c = np.array([r[f"{q}_critical"] for r in rs])
                rows.append(f"| {base} | {budget} | {q} | {len(rs)} | {b.sum(1).mean():.3g} | "
                            f"{c.sum(1).mean():.3g} | {c.sum(1).mean() / b.sum(1).mean():.2f} | "
                            f"{int((c.mean(0) < b.mean(0)).sum())} of {b.shape[1]} |")
                if len(rs) > 1:  # the claim, paired over samples: the registry's row
                    ids.append(_register_units(
                        rs, rs, "perturbation", cl.spec(rs[0]["critical"], r0["set"]),
                        cl.spec(base, r0["set"]), r0["task"],
                        r0["context"], "context_only", f"{budget} ({q} queries)",
                        [str(f.relative_to(ROOT))], (f"{q}_critical", f"{q}_base")))
        TABLES.append(ids)
        rows += ["", "The claim, the critical form's perturbation below its base's, paired "
                 "over the samples:", "", f"@@claims-table-{len(TABLES) - 1}@@"]
        blocks.append(
            f"{r0['task']}, {r0['context']} tokens, context-only (the paper's setting), "
            "methods at their defaults"
            + "".join(f", {k}={v}" for k, v in r0["set"].items())
            + f"; {report.model_line(recs)}; {f.relative_to(ROOT)} "
            f"(`python scripts/criticalkv_results.py --model {r0['model']} --perturb-only "
            f"{f.relative_to(ROOT)} --perturb-task {r0['task']} --context "
            f"{r0['context']} --pairs {','.join(dict.fromkeys(r['base'] for r in recs))} "
            f"--perturb-budgets {','.join(str(x) for x in dict.fromkeys(r['budget'] for r in recs))} "
            f"--perturb-samples {r0.get('samples', 1 + max(r['sample'] for r in recs))}"
            + "".join(f" --set {k}={v}" for k, v in r0["set"].items())
            + "`)." + short + " Per layer, the sum over a set of queries of "
            "||(o - o_hat) W_O||_1: o over the whole context, o_hat over the entries the "
            "method kept after compressing the context alone, hidden states from the full "
            "cache. `window`: the last window's context queries (the ones the base method "
            "scored); `question`: the question's queries, appended after compression (the "
            "paper measures the first decoded token). The critical rule is built to lower "
            "this number at the same budget:\n\n" + "\n".join(rows))
    return "\n\n".join(blocks) or None


def d2o(ctx: int) -> str | None:
    recs = records_at(ctx, *BASE[ctx], "d2o", "gaps", "gaps_k17")
    if not any(r["method"] == "d2o" for r in recs):
        return None
    # D2O's tables compare it with H2O, StreamingLLM, RoCo and CaM; d2o_code is D2O as
    # the authors' code reads it (docs/methods.md)
    pairs = [("d2o", "h2o", {}, {}), ("d2o", "streaming_llm", {}, {}),
             ("h2o", "streaming_llm", {}, {}), ("d2o", "roco", {}, {}), ("d2o", "cam", {}, {}),
             ("d2o_code", "h2o", {}, {}), ("d2o_code", "streaming_llm", {}, {})]
    gaps = "".join(f" and {f}" for f in sorted({Path(f).name for r in recs if r["method"] == "roco"
                                                 for f in r["_files"]}))
    kv_note = ""
    for r in recs:  # measured before records carried the KV after decoding
        if r["method"] == "d2o_code" and r.get("kv_fraction_end") is None:
            import numpy as np
            share = np.mean([d["layer_sizes"] for d in r["details"]]) / \
                r["prompt_tokens"]["mean"]
            kv_note += (f" d2o_code's kv at {r['budget']} is after the prefill, before its "
                        f"first decoding step evicts: its cache then holds {share:.3f} of the "
                        "prompt (the records' `layer_sizes`; layers 0, 1 and 29 whole).")
    out = (intro(ctx, recs, f"d2o_{ctx}.jsonl{gaps} and {_base_files(ctx)}",
                 " D2O at its defaults (merging on)" + ("; RoCo, CaM and d2o_code at theirs."
                                                       if gaps else ".") + kv_note)
           + "\n\n" + table(recs, {"full", "d2o", "d2o_code", "h2o", "streaming_llm", "roco",
                                    "cam"}) + "\n\n"
           + claims(recs, pairs, budgets(ctx)))
    rho = records_at(ctx, "d2o_rho", "d2o_nomerge")
    if any(r["method"] == "d2o" for r in rho):
        at = []  # a ratio's budget is [min, max] over the prompts' lengths
        for r in sorted(rho, key=lambda r: r["ratio"]):
            if r["budget"] not in [b for b, _ in at]:
                at.append((r["budget"], f"{1 - r['ratio']:.0%} kept ({r['budget']})"))
        on = {"merge": True}
        pairs = [("d2o", o, on, {}) for o in ("h2o", "streaming_llm")] + [
            ("h2o", "streaming_llm", {}, {}), ("d2o", "d2o", on, {"merge": False})]
        out += ("\n\n**At the paper's KV budgets**, 20% and 40% of the prompt (`--ratio "
                "0.8,0.6`; docs/results/smollm2/d2o_rho_{0}.jsonl, d2o_nomerge_{0}.jsonl), "
                "merging on and off:\n\n".format(ctx)
                + table(rho + [r for r in recs if r["method"] == "full"],
                        {"full", "d2o", "h2o", "streaming_llm"}) + "\n\n"
                + claims(rho, pairs, tuple(at)))
    return out + _layer_plot(ctx, [r for r in recs if r["method"] in ("d2o", "d2o_code")],
                             key="layer_sizes", page="d2o", heads=1)


def _t95(n: int) -> float:
    """Student's t quantile 0.975 with n - 1 degrees of freedom (Cornish-Fisher; within
    0.01 of the table from 8 blocks on, 0.05 at 5)."""
    z, d = 1.959964, n - 1
    return z + (z**3 + z) / (4 * d) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * d**2)


def _mean_ci(xs) -> tuple[float, float, float]:
    """Mean of xs and its 95% t-interval."""
    import numpy as np

    xs = np.asarray(xs, float)
    half = _t95(len(xs)) * xs.std(ddof=1) / len(xs) ** 0.5
    return xs.mean(), xs.mean() - half, xs.mean() + half


# the paper's claims, then a reading of ours: D2O's layer budgets against uniform ones
PPL_CLAIMS = [("d2o", "h2o"), ("d2o", "streaming_llm"), ("d2o", "d2o:merge=false"),
              ("d2o", "d2o:variance_layers=false"),
              ("d2o", "roco"), ("d2o", "cam"),  # the paper's Table 1 baselines too
              ("d2o_code", "h2o"), ("d2o_code", "streaming_llm")]  # the authors' code


def d2o_perplexity(folder=None) -> str | None:
    """Teacher-forced perplexity with each method's cache, from `folder`'s (SmolLM2's by
    default) d2o_ppl_<text>.jsonl: each with a 95% interval over its 128-token blocks
    (blocks, not tokens, are the unit: neighbouring tokens are not independent), and the
    paper's claims as paired block differences of mean NLL."""
    import math

    blocks = []
    for f in sorted((folder or RECORDS).glob("d2o_ppl_*.jsonl")):
        # the whole span (the script also writes the spans before and after its --ppl-split)
        recs = [r for r in report.load_records(f)
                if r.get("span", f"{r['prompt']}-{r['tokens']}") == f"{r['prompt']}-{r['tokens']}"]
        if not recs:
            continue
        r0 = recs[0]
        rhos = sorted({r["rho"] for r in recs if r["rho"] < 1})
        if not rhos:  # the full cache alone so far
            continue
        at = {(r["label"], r["rho"]): r for r in recs}

        def ppl(r):
            m, lo, hi = _mean_ci(r["nll_blocks"])
            return f"{math.exp(m):.2f} [{math.exp(lo):.2f}, {math.exp(hi):.2f}]"

        rows = ["| method | " + " | ".join(f"rho {x:g}" for x in rhos) + " |",
                "|---|" + "---|" * len(rhos)]
        if ("full", 1.0) in at:
            rows.append(f"| full (the whole cache) | {ppl(at['full', 1.0])}" + " |" * len(rhos))
        for label in dict.fromkeys(r["label"] for r in recs if r["label"] != "full"):
            rows.append(f"| {label} | " + " | ".join(
                ppl(at[label, x]) if (label, x) in at else "-" for x in rhos) + " |")
        ids = [_register_units([at[a, x]], [at[b, x]], "nll", a, b, r0["text"], r0["tokens"],
                               "perplexity", f"rho {x:g}", [str(f.relative_to(ROOT))])
               for a, b in PPL_CLAIMS for x in rhos if (a, x) in at and (b, x) in at]
        TABLES.append(ids)
        claims = (f"\n\nThe paper's claims (and, last, D2O's layer budgets against uniform "
                  "ones) as paired differences (the same blocks under both methods; below 0: "
                  f"the first predicts the text better):\n\n@@claims-table-{len(TABLES) - 1}@@"
                  if ids else "\n\nNo declared comparison (PPL_CLAIMS) has both of its "
                  "methods measured yet.")
        wall = sum(r.get("wall_s", 0) for r in recs) / 60
        n = r0["tokens"] - r0["prompt"]
        blocks.append(
            f"**{r0['text']}** ({f.name}): the first {r0['prompt']} of {r0['tokens']} tokens "
            f"prefilled into each method's cache at rho of the prompt, the other {n} fed one "
            f"at a time, each method evicting (and D2O merging) at every step; perplexity "
            f"over those {n} tokens, with a 95% interval over their "
            f"{len(r0['nll_blocks'])} blocks of 128 ({wall:.0f} min on 2 cores; `python "
            f"scripts/d2o_results.py --model {r0['model']} --ppl-only "
            f"{f.relative_to(ROOT)} --ppl-text {r0['text']} --ppl-tokens "
            f"{r0['tokens']} --prompt {r0['prompt']} --methods "
            f"{','.join(dict.fromkeys(r['label'] for r in recs))} --ratios "
            f"{','.join(f'{x:g}' for x in rhos)}`):\n\n" + "\n".join(rows) + claims)
    return "\n\n".join(blocks) or None


def sliminfer(ctx: int) -> str | None:
    recs = records_at(ctx, *BASE[ctx], "sliminfer")
    if not any(r["method"] == "sliminfer" for r in recs):
        return None
    pairs = [("sliminfer", "full", {}, {}), ("lazyllm", "full", {}, {}),
             ("sliminfer", "lazyllm", {}, {})]
    return (intro(ctx, recs, f"sliminfer_{ctx}.jsonl and {_base_files(ctx)}",
                  " SlimInfer and LazyLLM prune the prefill itself and run their own "
                  "(not shared): their TTFT is the whole prefill, against full's. Their "
                  "budget is their pruning schedule (defaults); `kv` is what stays on the "
                  "device.")
            + "\n\n" + table(recs, {"full", "sliminfer", "lazyllm"}) + "\n\n"
            + _prefill_cost(recs, ctx) + claims(recs, pairs, (None,)) + _slim_decode(recs)
            + _sliminfer_eq(ctx))


def _slim_decode(recs: list[dict]) -> str:
    """SlimInfer's decode on the real model, from the records' per-sample statistics: the
    share of (step, stage) pairs that swapped blocks, and the KV it keeps on the device."""
    import numpy as np

    out = []
    for r in recs:
        d = r["details"]
        if r["method"] != "sliminfer" or not all("swap_fraction" in x for x in d):
            continue
        swap = np.mean([x["swap_fraction"] for x in d])
        steps = np.mean([x["swap_step_fraction"] for x in d])
        dev = np.mean([x["device_kv_bytes"] / x["device_kv_bytes_full"] for x in d])
        h2d = np.mean([x["bytes_per_step"] for x in d]) / 2 ** 20
        at = f" at {r['budget']}" if r["budget"] else ""
        out.append(f"{_name(r)}{at}: {100 * swap:.0f}% of the (step, stage) pairs swapped "
                   f"blocks ({100 * steps:.0f}% of the steps), {h2d:.2f} MiB copied to the "
                   f"device a step, device-resident KV {dev:.2f} of the full cache's after the "
                   "last step")
    if not out:
        return ""
    return ("\n\nDecoding (means over the samples of the records' `swap_fraction`, "
            "`swap_step_fraction`, `bytes_per_step`, `device_kv_bytes`): "
            + "; ".join(out) + ".")


SLIM_EQ = {192: "kvjax's floored schedule, (12, 6, 3) blocks", 128: "the paper's, (8, 4, 2) blocks"}


def _needle_text(r: dict) -> str:
    """Where SlimInfer's needle went (`_needle_kept`) in one clause; "" without spans."""
    kept, n, ok_kept, ok_lost = _needle_kept(r)
    if not n:
        return ""
    return (f"the needle's blocks survived stage 1, 2, 3 in {', '.join(map(str, kept))} of "
            f"{n} prompts; answered {ok_kept} of the {kept[-1]} whose needle every stage kept, "
            f"{ok_lost} of the {n - kept[-1]} whose needle a stage dropped")


def _needle_kept(r: dict) -> tuple[list[int], int, int, int]:
    """SlimInfer's samples whose needle (the answer's tokens, `answer_span`) sat in a block
    each pruning stage kept: [samples kept by stages 1..i], the samples with a span, and the
    correct answers among those whose needle every stage kept / some stage dropped."""
    d = [x for x in r["details"] if x.get("answer_span") and x.get("kept_blocks")]
    block = r["method_params"]["block"]
    kept, right = [0] * max((len(x["kept_blocks"]) for x in d), default=0), [0, 0]
    for x in d:
        a, b = x["answer_span"]
        need = set(range(a // block, (b - 1) // block + 1))
        alive = True
        for i, ks in enumerate(x["kept_blocks"]):
            alive = alive and need <= set(ks)
            kept[i] += alive
        right[not alive] += x["score"] == 1.0
    return kept, len(d), right[0], right[1]


def _sliminfer_eq(ctx: int) -> str:
    """SlimInfer against LazyLLM at equal kept tokens per stage (`--budget B` for both: the
    last stage keeps B tokens, the earlier 2B and 4B), and which stage dropped the needle."""
    recs = records_at(ctx, "sliminfer_eq")
    if not any(r["method"] == "sliminfer" for r in recs):
        return ""
    full = [r for r in records_at(ctx, *BASE[ctx]) if r["method"] == "full"]
    at = tuple((b, f"{4 * b}/{2 * b}/{b} tokens") for b in sorted(
        {r["budget"] for r in recs}, reverse=True))
    pairs = [("sliminfer", "full", {}, {}), ("lazyllm", "full", {}, {}),
             ("sliminfer", "lazyllm", {}, {})]
    lines = [f"at {r['budget']} ({SLIM_EQ.get(r['budget'], 'scaled')}): {_needle_text(r)}"
             for r in sorted(recs, key=lambda r: -r["budget"])
             if r["method"] == "sliminfer" and _needle_text(r)]
    needle = ("\n\nWhere the needle went (the records' `kept_blocks` per pruning stage "
              "against the block of the answer's tokens in the prompt, `answer_span`): "
              + "; ".join(lines) + ".") if lines else ""
    return (f"\n\n**At equal kept tokens** (docs/results/smollm2/sliminfer_eq_{ctx}.jsonl, "
            f"`--method sliminfer,lazyllm --budget {','.join(str(b) for b, _ in at)}`): both "
            "keep 4B, 2B and B tokens after their three pruning layers, SlimInfer as whole "
            "blocks of 64, LazyLLM as single tokens; B = 192 is the schedule of the defaults "
            "above, B = 128 the paper's own (8k, 4k, 2k of 32k scaled to 2048: 8, 4, 2 "
            "blocks, below kvjax's 3-block floor: `min_blocks`, docs/methods.md).\n\n"
            + table(full + recs, {"full", "sliminfer", "lazyllm"}) + "\n\n"
            + claims(full + recs, pairs, at) + needle + _slim_decode(recs))


def _prefill_cost(recs: list[dict], ctx: int) -> str:
    """SlimInfer's and LazyLLM's prefill FLOPs (from the records' per-layer token counts)
    and TTFT as fractions of full's."""
    from kvjax import api
    from kvjax.methods.slim.blocks import prefill_flop_ratio
    from kvjax.models import gguf

    path = api.packaged_file("smollm2-135m")
    cfg = gguf.config(gguf.reader(path), path)
    full = find(recs, "full")
    parts = []
    for r in recs:
        if r["method"] in ("sliminfer", "lazyllm"):
            d = r["details"][0]  # the stage shapes are the bucket's, the same every sample
            flops = prefill_flop_ratio(cfg, d["layer_tokens"], ctx, d["mlp_tokens"])
            parts.append(f"{r['method']} {flops:.2f} of full's FLOPs, TTFT "
                         f"{r['ttft_s'] / full['ttft_s']:.2f} of full's")
    return ("Prefill cost (`kvjax.methods.slim.blocks.prefill_flop_ratio` over the tokens "
            "each layer ran; TTFT per batch of 8): " + "; ".join(parts) + ".\n\n")


def _asl_layers(recs: list[dict], method: str = "asl") -> str:
    import collections

    r = next(r for r in recs if r["method"] == method)
    fell = sum(bool(d.get("fallback_snapkv")) for d in r["details"])
    at = collections.Counter(d.get("selection_layer") for d in r["details"]
                             if d.get("selection_layer") not in (-1, None))
    layers = ", ".join(f"{l} ({n})" for l, n in sorted(at.items()))
    return (f"{fell} of {len(r['details'])} prompts never crossed tau = "
            f"{r['method_params']['tau']} and fell back to SnapKV's selection (kernel "
            f"{r['method_params']['kernel']}); layers chosen otherwise (prompts): "
            f"{layers or 'none'}")


def asl(ctx: int) -> str | None:
    recs = records_at(ctx, *BASE[ctx], "asl")
    if not any(r["method"] == "asl" for r in recs):
        return None
    pairs = [("asl", "fastkv", {}, {}), ("asl", "gemfilter", {}, {}),
             ("asl", "snapkv", {}, K17)]
    b8 = budgets(ctx)[0]
    return (intro(ctx, recs, f"asl_{ctx}.jsonl and {_base_files(ctx)}",
                  f" ASL, FastKV and GemFilter select {b8[0]} tokens (1/8) at their "
                  "selection layer and run their own prefill (not shared). ASL's selection "
                  "layer: " + _asl_layers(recs) + ".")
            + "\n\n" + table([r for r in recs if r["method"] != "snapkv" or
                                params(r).get("kernel") == 17],
                               {"full", "asl", "fastkv", "gemfilter", "snapkv"})
            + "\n\n" + claims(recs, pairs, (b8,)) + _asl_k17(ctx) + _asl_lmin(ctx))


LMIN = {**K17, "rank_from": "l_min"}


def _asl_lmin(ctx: int) -> str:
    """ASL, asl_full_before and asl_2pass with ranks from L_min on (the reading under which
    ASL selects on the dev seed), against FastKV and GemFilter at kernel 17."""
    recs = records_at(ctx, "asl_lmin_k17")
    if not any(r["method"] == "asl" for r in recs):
        return ""
    others = [r for r in records_at(ctx, "asl_k17", "asl_eqkv_k17")
              if r["method"] in ("fastkv", "gemfilter")]
    full = [r for r in records_at(ctx, *BASE[ctx]) if r["method"] == "full"]
    pairs = [("asl", "fastkv", LMIN, {**K17, "tsp_rate": 0.2}),
             ("asl", "fastkv", LMIN, {**K17, "tsp_rate": 0.125}),
             ("asl", "gemfilter", LMIN, K17), ("asl_2pass", "gemfilter", LMIN, K17),
             ("asl_full_before", "asl", LMIN, LMIN)]
    return (f"\n\n**With ranks from L_min on** (`rank_from=l_min`, Appendix D's reading: "
            f"ASL \"starts the operation\" at L_min; docs/results/smollm2/asl_lmin_k17_{ctx}"
            ".jsonl, kernel 17, tau 0.3 as the paper): the reading chosen on the dev seed, "
            "the one reading of the paper under which ASL selects with the paper's tau and "
            "L_obs (\"The selection curve\" below). ASL's selection layer: "
            + _asl_layers(recs) + ".\n\n"
            + table(full + recs + others, {"full", "asl", "asl_full_before", "asl_2pass",
                                           "fastkv", "gemfilter"}) + "\n\n"
            + claims(recs + others, pairs, (budgets(ctx)[0],)))


def _asl_k17(ctx: int) -> str:
    """ASL, FastKV and GemFilter with SnapKV's pooling at kernel 17 (when the records exist)."""
    recs = records_at(ctx, "asl_k17", "asl_full_before_k17", "asl_eqkv_k17")
    if not any(r["method"] == "asl" for r in recs):
        return ""
    # FastKV at its default TSP rate (20%), and at 12.5%, where its live KV is ASL's
    pairs = [("asl", "fastkv", K17, {**K17, "tsp_rate": 0.2}), ("asl", "gemfilter", K17, K17)]
    if any(r["method"] == "asl_full_before" for r in recs):
        pairs.append(("asl_full_before", "asl", K17, K17))
    if any(params(r).get("tsp_rate") == 0.125 for r in recs):
        pairs.append(("asl", "fastkv", K17, {**K17, "tsp_rate": 0.125}))
    full = [r for r in records_at(ctx, *BASE[ctx]) if r["method"] == "full"]
    return ("\n\n**At kernel 17** (docs/results/smollm2/asl_k17_{0}.jsonl, "
            "asl_full_before_k17_{0}.jsonl, asl_eqkv_k17_{0}.jsonl): the methods pool their "
            "scores with kernel 17, as the SnapKV rows do; FastKV also at a TSP rate of 12.5%, "
            "where its live KV equals ASL's (at its default 20% every layer from its TSP layer "
            "on keeps all the propagated tokens). ASL's selection layer: {1}.\n\n".format(
                ctx, _asl_layers(recs))
            + table(full + recs, {"full", "asl", "asl_full_before", "fastkv", "gemfilter"})
            + "\n\n" + claims(recs, pairs, (budgets(ctx)[0],)))


ASL_DEV = {"default": "the defaults", "rank_from_l_min": "rank_from=l_min",
           "head_ranking_per_head": "head_ranking=per_head", "l_obs_4": "l_obs=4",
           "l_obs_2": "l_obs=2"}  # the dev runs (sweeps_smollm2.sh) and their readings
ASL_TAUS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _relvar(r: dict, at_lmin: bool = True):
    """[prompts, layers] relative rank variance (NaN before L_min and after a selection;
    `at_lmin=False`: NaN at L_min too, where it is 1 by definition)."""
    import numpy as np

    rv = np.array([[np.nan if x is None else x for x in d["relative_variance"]]
                   for d in r["details"]], float)
    if not at_lmin:
        rv[np.arange(len(rv)), np.argmax(~np.isnan(rv), axis=1)] = np.nan
    return rv


def _first_below(rv, tau: float):
    """Per prompt, the first layer after L_min whose relative variance is below tau (-1:
    none): where ASL at that tau would select, read from a curve recorded without
    selecting (exact only where no selection cut the curve short)."""
    import numpy as np

    hit = rv < tau  # NaN compares False
    return np.where(hit.any(axis=1), hit.argmax(axis=1), -1)


def _tau_table(curves) -> list[str]:
    """Markdown rows: per (label, [prompts, layers] curve without L_min's 1), the lowest
    value after L_min and the prompts that would select at each of ASL_TAUS, and where."""
    import numpy as np

    rows = ["| records | prompts | lowest after L_min: min / median | "
            + " | ".join(f"select at tau {t:g}" for t in ASL_TAUS) + " |",
            "|---|---|---|" + "---|" * len(ASL_TAUS)]
    for what, after in curves:
        low = np.nanmin(after, axis=1)
        cells = []
        for t in ASL_TAUS:
            at = _first_below(after, t)
            layers = sorted(set(at[at >= 0].tolist()))
            cells.append(f"{(at >= 0).sum()}" + (f" (layers {layers[0]}-{layers[-1]})"
                                                 if len(layers) > 1 else
                                                 f" (layer {layers[0]})" if layers else ""))
        rows.append(f"| {what} | {len(after)} | {low.min():.2f} / {np.median(low):.2f} | "
                    + " | ".join(cells) + " |")
    return rows


def _relvar_png(curves, title: str, name: str) -> None:
    """docs/results/<name>: per (label, [prompts, layers] relative rank variance from L_min
    on, the same without L_min's 1) its median and 10-90% band per layer, and the share of
    prompts whose curve falls below each tau (where ASL at that tau would select)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from results_overview import _quantize

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.4))
    taus = np.linspace(0.01, 1.0, 100)
    for what, rv, after in curves:
        keep = ~np.isnan(rv).all(0)  # the layers from L_min on
        line, = ax.plot(np.flatnonzero(keep), np.nanmedian(rv[:, keep], axis=0), label=what,
                        lw=1.2)
        lo, hi = np.nanpercentile(rv[:, keep], [10, 90], axis=0)
        ax.fill_between(np.flatnonzero(keep), lo, hi, color=line.get_color(), alpha=0.12)
        bx.plot(taus, [(_first_below(after, t) >= 0).mean() * 100 for t in taus],
                color=line.get_color(), lw=1.2)
    ax.axhline(0.3, color="black", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("layer", fontsize=9)
    ax.set_ylabel("var / var(L_min): median, 10-90%", fontsize=9)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7,
               frameon=False)
    ax.grid(alpha=0.3)
    bx.axvline(0.3, color="black", ls="--", lw=0.8)
    bx.set_xlabel("tau", fontsize=9)
    bx.set_ylabel("% of prompts that select", fontsize=9)
    bx.set_ylim(-2, 102)
    bx.grid(alpha=0.3)
    fig.suptitle(f"{title}: ASL's relative rank variance (tau = 0.3 dashed)", fontsize=10)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    png = ROOT / "docs" / "results" / name
    fig.savefig(png, dpi=80)
    plt.close(fig)
    _quantize(png)


def asl_curves() -> str | None:
    """ASL's per-layer relative rank variance on SmolLM2 (seed 0 at kernels 7 and 17, and the
    dev seed's readings with tau = 1e-6, which never select and so record every layer):
    docs/results/asl_relvar_smollm2.png, and per reading the prompts that would select at
    each tau and where."""
    import numpy as np

    curves = []
    for f, what in (("asl_1024", "seed 0, kernel 7, 1024"), ("asl_2048", "seed 0, kernel 7, 2048"),
                    ("asl_k17_1024", "seed 0, kernel 17, 1024"),
                    ("asl_lmin_k17_1024", "seed 0, kernel 17, rank_from=l_min, 1024"),
                    *((f"asl_dev_s1_{v}_1024", f"dev seed 1, kernel 17, {ASL_DEV[v]}")
                      for v in ASL_DEV)):
        path = RECORDS / f"{f}.jsonl"
        r = next((r for r in report.load_records(path) if r["method"] == "asl"), None) \
            if path.exists() else None
        if r is not None and r["samples"] >= 50:
            curves.append((what, f, _relvar(r), _relvar(r, False)))
    if not curves:
        return None
    _relvar_png([(what, rv, after) for what, _, rv, after in curves], "SmolLM2-135M, niah_single",
                "asl_relvar_smollm2.png")
    rows = _tau_table([(f"{what} ({f}.jsonl)", after) for what, f, _, after in curves])
    return ("ASL selects at the first layer after L_min (layer "
            f"{int(np.argmax(~np.isnan(curves[0][2][0])))} of 30 here) whose relative rank "
            "variance falls below tau. The curves below are the records' `relative_variance` "
            "(the dev seed's with tau = 1e-6, which never selects, so every layer's value is on "
            "all the prompt's tokens); the prompts that would select at a tau and where follow "
            "from them (seed 0's, run at tau 0.3, are exact below 0.3 only for the prompts that "
            "did not select: a selection cuts the curve short). Rendered by `python "
            "scripts/smollm2_results.py`; the dev runs: "
            "`scripts/sweeps_smollm2.sh` (asl_dev_s1_*).\n\n"
            "![ASL relative rank variance](asl_relvar_smollm2.png)\n\n" + "\n".join(rows))


# what a claim compares (not `metric`, which the scores decide: binary or not)
CLAIM_IDENTITY = ("model", "paper", "page", "task", "context", "scenario", "budget", "a", "b",
                  "kind", "seed", "records")


def claim_id(r: dict) -> str:
    """A claim's id: 8 hex digits of a hash of what it compares, never of its results, so an
    id cited on a page names the same comparison after later sweeps register others (an
    index into claims.jsonl renumbered on every render) and as its records grow."""
    import hashlib
    import json

    what = json.dumps({k: r[k] for k in CLAIM_IDENTITY}, sort_keys=True)
    return hashlib.sha1(what.encode()).hexdigest()[:8]


def write_registry() -> list[dict]:
    """Judge every registered comparison (Holm over each paper's on the model) and write
    docs/results/claims.jsonl, one line a comparison."""
    import json

    from kvjax import claims as cl

    rows = cl.judge(REGISTRY)
    for r in rows:
        r["id"] = claim_id(r)
    seen: dict[str, dict] = {}
    for r in rows:
        if r["id"] in seen:
            o = seen[r["id"]]
            same = all(o[k] == r[k] for k in CLAIM_IDENTITY)
            raise ValueError(
                f"two claims share id {r['id']}: {r['a']} vs {r['b']} ({r['records']}) and "
                f"{o['a']} vs {o['b']} ({o['records']}): "
                + ("the same comparison registered twice" if same else
                   "a hash collision: lengthen claim_id"))
        seen[r["id"]] = r
    path = ROOT / "docs" / "results" / "claims.jsonl"
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return rows


def _fill(text: str, rows: list[dict]) -> str:
    import re

    text = re.sub(r"@@claims-table-(\d+)@@",
                  lambda m: claims_table([rows[i] for i in TABLES[int(m.group(1))]]), text)
    return re.sub(r"@@claim-row-(\d+)@@", lambda m: _row_cells(rows[int(m.group(1))]), text)


def _row_cells(r: dict) -> str:
    return (f"{r['verdict']} | {r['reason']} ({r['a_wins']} : {r['b_wins']}, "
            f"p {r['p']:.2g}, Holm {r['p_holm']:.2g}; claims.jsonl #{r['id']})")


def section(render, *extra) -> str | None:
    """A page's SmolLM2 section: a block per context measured (and the extra blocks)."""
    blocks = [(f"{ctx} tokens", render(ctx)) for ctx in CONTEXTS] + list(extra)
    body = "\n\n".join(f"### {head}\n\n{b}" for head, b in blocks if b)
    return body or None


def slim(path: Path, every: bool = False) -> None:
    """Drop what makes these records 50 KB each and says nothing here: the per-batch
    `layer_budgets` and the per-sample ones ([L, K] a sample; Ada-SnapKV's per-head counts
    were 25 KB a record; where a sample's layers differ their sums over heads stay), and
    each per-batch statistic every sample's details repeat (SlimInfer's kept blocks: 0.8 MB
    a record; `kvjax.run` no longer writes them twice), and the benchmark records'
    `predictions` where the details hold the same (cwe's: 0.3 MB a file). With `every` also each
    per-sample statistic over 512 bytes (LazyLLM's kept blocks, D2O's thresholds, LAVa's
    layer weights: up to 15 KB a sample); the pages read accuracy, budgets, timings, the
    selection layers, and each sample's entries per layer summed over its heads
    (`layer_totals`, kept where the layers' budgets differ). Always dropped: a sample's
    `budget` where it is the record's, and `correct` where it is `score == 1`."""
    import json

    out = []
    for r in report.load_records(path):
        stats = r.get("method_stats") or {}
        stats.pop("layer_budgets", None)
        details = r.get("details") or []
        # per layer, summed over heads, where some sample's layers differ (LAVa's plot);
        # a slimmed batches file (`slim_batches`) has the sums already
        totals = [[sum(x) for x in d["layer_budgets"]] if d.get("layer_budgets")
                  else d.get("layer_totals") for d in details]
        keep = all(totals) and any(len(set(t)) > 1 for t in totals)
        for d, t in zip(details, totals):
            if keep:
                d["layer_totals"] = t
            else:
                d.pop("layer_totals", None)
        # a batch at a time what every sample carries already (as `kvjax.run` now writes)
        for k in set(stats).intersection(*details) if details else ():
            stats.pop(k)
        # each prediction where the details hold it (as `kvjax.run --details` now writes)
        if details and r.get("predictions") and r["predictions"] == report.sample_predictions(
                details):
            r.pop("predictions")
        if every:
            for d in details:
                for k in [k for k, v in d.items() if len(json.dumps(v)) > 512]:
                    d.pop(k)
        for d in details:
            d.pop("layer_budgets", None)
            # what the record says already: its budget, and `correct` (= score 1)
            if "budget" in d and d["budget"] == r["budget"]:
                d.pop("budget")
            if "correct" in d and d["correct"] == (d.get("score") == 1.0):
                d.pop("correct")
        out.append(json.dumps(r) + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(out))
    tmp.replace(path)


def slim_batches(path: Path) -> None:
    """A sweep's unfinished batches file (`<records>.jsonl.batches`) made small enough to
    commit, and still resumable: each batch's per-batch `layer_budgets` (the samples' own,
    stacked) dropped, each sample's [L, K] `layer_budgets` replaced by its per-layer sums
    (`slim` keeps those only where layers differ once the record is written)."""
    import json

    out = []
    for line in path.read_text().splitlines():
        try:
            piece = json.loads(line)
        except ValueError:  # a line cut off by a kill: `--resume` skips it too
            continue
        piece["piece"]["extra"].pop("layer_budgets", None)
        for _, d in piece["piece"]["samples"]:
            if d.get("layer_budgets"):
                d["layer_totals"] = [sum(x) for x in d.pop("layer_budgets")]
        out.append(json.dumps(piece) + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(out))
    tmp.replace(path)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slim", nargs="+", type=Path, metavar="FILE",
                   help="only drop the per-layer budgets of these records files (per-layer "
                        "sums kept where layers differ), or of a sweep's unfinished "
                        "<records>.jsonl.batches (still resumable)")
    p.add_argument("--every-method", action="store_true",
                   help="with --slim: also drop per-batch statistics the samples repeat "
                        "and per-sample ones over 512 bytes")
    p.add_argument("--qwen-kernel", nargs="?", const="niah_multikey_2", metavar="TASK",
                   help="print SnapKV's pooling kernel for the Qwen claims, chosen on RULER's "
                        "dev samples of niah_multikey_2 (or of TASK: that task's own choice; "
                        "scripts/sweeps_qwen.sh pooling), and exit; exit 2 with the reason "
                        "before that sweep is complete")
    p.add_argument("--qwen-asl", action="store_true",
                   help="print the --set arguments of ASL's reading for the Qwen claims, "
                        "chosen on RULER's dev samples (scripts/sweeps_qwen.sh asl_dev), and "
                        "exit; exit 2 before that run is complete")
    a = p.parse_args(argv)
    # a choice made on the dev samples, printed for scripts/sweeps_qwen.sh: (value, why,
    # the section that makes it); None until that section is complete
    for asked, what, choose, part in (
            (a.qwen_asl, "ASL reading", qwen_dev_asl, "asl_dev"),
            (a.qwen_kernel, "kernel", lambda: qwen_dev_kernel(a.qwen_kernel), "pooling")):
        if asked:
            value, why = choose()[:2]
            if value is None:
                print(f"error: no {what} chosen yet: {why} (scripts/sweeps_qwen.sh {part})",
                      file=sys.stderr)
                return 2
            print(value)
            return 0
    if a.slim:
        for f in a.slim:
            slim_batches(f) if f.name.endswith(".batches") else slim(f, a.every_method)
        return 0
    records = load()
    calib = calibration(records)
    pool = pooling(records)
    pages = {}
    for page, render in (("baselines", lambda: section(baselines, ("passkey, 1024 tokens",
                                                                   baselines(1024, "passkey")))),
                         ("lava", lambda: section(lava)),
                         ("criticalkv", lambda: section(criticalkv,
                                                        ("Output perturbation", perturbation()))),
                         ("d2o", lambda: section(d2o, ("Perplexity of a long text",
                                                       d2o_perplexity()))),
                         ("sliminfer", lambda: section(sliminfer)),
                         ("asl", lambda: section(asl, ("The selection curve", asl_curves())))):
        PAGE["name"] = page
        pages[page] = render()
    PAGE["name"] = "baselines"
    qwen = qwen_baselines()
    qwen_pages = {}
    for page in QWEN_PAPER_PAIRS:
        PAGE["name"] = page
        qwen_pages[page] = qwen_papers(page)
    for page in QWEN_PREFILL:
        PAGE["name"] = page
        qwen_pages[page] = qwen_prefill(page)
    qwen15_pages = {}
    for page in ("baselines", *QWEN_PAPER_PAIRS, *QWEN_PREFILL):
        PAGE["name"] = page
        qwen15_pages[page] = qwen15(page)
    PAGE["name"] = "baselines"
    rows = write_registry()
    fill = lambda text: _fill(text, rows)  # noqa: E731
    report.replace_section(ROOT / "MODEL.md", "smollm2-calibration", fill(calib))
    report.replace_section(ROOT / "docs" / "results" / "pooling.md", "pooling", pool)
    for page, body in pages.items():
        if body:
            report.replace_section(ROOT / "docs" / "results" / f"{page}.md", f"smollm2-{page}",
                                   fill(body))
    report.replace_section(ROOT / "docs" / "results" / "baselines.md", "qwen-baselines",
                           fill(qwen))
    report.replace_section(ROOT / "docs" / "results" / "pooling.md", "qwen-pooling",
                           qwen_poolings())
    for page, body in qwen_pages.items():
        if body:
            report.replace_section(ROOT / "docs" / "results" / f"{page}.md", f"qwen-{page}",
                                   fill(body))
    for page, body in qwen15_pages.items():
        report.replace_section(ROOT / "docs" / "results" / f"{page}.md", f"qwen-15b-{page}",
                               fill(body))
    print(f"rendered from {len(records)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
