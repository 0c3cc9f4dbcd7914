"""Paired verdicts on the papers' claims: every method of a sweep answers the same prompts,
so two methods are compared sample by sample, never by two unpaired intervals.

The rules (docs/results/README.md states them in words):
- a binary task (a sample scores 0 or 1): the exact two-sided McNemar test, i.e. a binomial
  test on the discordant pairs only (a right where b is wrong, and the reverse); the paired
  95% interval of a - b by Newcombe's hybrid score method (Newcombe 1998, Stat. Med. 17,
  "Improved confidence intervals for the difference between binomial proportions based on
  paired data", method 10);
- a score metric (a partial match, F1): an exact sign-flip permutation test of the paired
  differences (Monte Carlo with a fixed seed past 2^16 sign patterns) and a paired bootstrap
  percentile interval;
- Holm's step-down correction over a paper's declared comparisons on one model;
- a verdict is one of `VERDICTS`, decided by `verdict`.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from kvjax.report import wilson

VERDICTS = ("holds", "does not hold", "cannot tell", "uninformative")
KINDS = ("better", "no worse")  # "a beats b"; "a loses at most `margin` against b"
ALPHA = 0.05
FLOOR, CEILING = 0.10, 0.95  # both arms at or below / at or above: the cell measures nothing
MARGIN = 0.05  # "no worse": 5 points unless the paper states its own


def discordant(a: list[float], b: list[float]) -> tuple[int, int]:
    """(samples where a scores above b, the reverse): for binary scores, the samples a
    gets right and b wrong, and the reverse."""
    _same_length(a, b)
    return (sum(1 for x, y in zip(a, b) if x > y), sum(1 for x, y in zip(a, b) if y > x))


def mcnemar(a_wins: int, b_wins: int) -> float:
    """Exact two-sided McNemar p: under "no difference" each discordant pair is a's or b's
    with probability 1/2, so the count of a's is Binomial(a_wins + b_wins, 1/2)."""
    n = a_wins + b_wins
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(a_wins, b_wins) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1), in the input's order."""
    m = len(ps)
    out, run = [0.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: ps[i])):
        run = max(run, min(1.0, (m - rank) * ps[i]))
        out[i] = run
    return out


def newcombe(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float]:
    """Paired interval of accuracy(a) - accuracy(b) for binary scores (Newcombe's method
    10, "square and add": the two marginal Wilson intervals, combined with the pairs' phi
    correlation)."""
    _same_length(a, b)
    n = len(a)
    both = sum(1 for x, y in zip(a, b) if x and y)
    a_only, b_only = discordant(a, b)
    neither = n - both - a_only - b_only
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    l1, u1 = wilson(both + a_only, n, z)
    l2, u2 = wilson(both + b_only, n, z)
    # phi, the correlation of the two marginal proportions, with Newcombe's correction
    # toward 0 by n/2 where it is positive (and 0 where ad - bc lies in [0, n/2])
    margins = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    ad_bc = both * neither - a_only * b_only
    ad_bc = ad_bc - n / 2 if ad_bc > n / 2 else min(ad_bc, 0)
    phi = ad_bc / math.sqrt(margins) if margins else 0.0
    d = p1 - p2
    lo = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    hi = d + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return max(-1.0, lo), min(1.0, hi)


def sign_flip(a: list[float], b: list[float], rounds: int = 100_000, seed: int = 0) -> float:
    """Two-sided p of the paired sign-flip permutation test on mean(a - b): exact over
    every sign pattern of the nonzero differences up to 2^16 of them, else `rounds` random
    patterns drawn with `seed` (the observed one counted, so p > 0)."""
    _same_length(a, b)
    d = np.asarray(a, float) - np.asarray(b, float)
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    obs = abs(d.sum())
    if d.size <= 16:
        signs = 1 - 2 * ((np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1)
        return float(np.mean(np.abs(signs @ d) >= obs - 1e-12))
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(rounds, d.size))
    return float((1 + np.sum(np.abs(signs @ d) >= obs - 1e-12)) / (rounds + 1))


def bootstrap(a: list[float], b: list[float], level: float = 0.95, rounds: int = 10_000,
              seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap percentile interval of mean(a - b) (samples resampled in pairs)."""
    _same_length(a, b)
    d = np.asarray(a, float) - np.asarray(b, float)
    idx = np.random.default_rng(seed).integers(0, d.size, size=(rounds, d.size))
    means = d[idx].mean(1)
    q = (1 - level) / 2
    return float(np.quantile(means, q)), float(np.quantile(means, 1 - q))


def compare(a: list[float], b: list[float], binary: bool) -> dict:
    """The paired statistics of one comparison: accuracies, wins, p and the 95% interval
    of a - b (McNemar and Newcombe for binary scores, sign-flip and bootstrap otherwise)."""
    _same_length(a, b)
    a_wins, b_wins = discordant(a, b)
    lo, hi = newcombe(a, b) if binary else bootstrap(a, b)
    return {"n": len(a), "a_acc": sum(a) / len(a), "b_acc": sum(b) / len(b),
            "a_wins": int(a_wins), "b_wins": int(b_wins),
            "p": mcnemar(a_wins, b_wins) if binary else sign_flip(a, b),
            "diff_lo": lo, "diff_hi": hi,
            "test": "exact McNemar, Newcombe interval" if binary
            else "sign-flip permutation, paired bootstrap interval"}


def verdict(kind: str, s: dict, p_holm: float, margin: float = MARGIN,
            bounded: bool = True) -> tuple[str, str]:
    """The verdict on "a beats b" (`better`) or "a is no worse than b by more than
    `margin`" (`no worse`) from the statistics of `compare` and the Holm-adjusted p.
    `bounded`: the scores are accuracies in [0, 1], where a floor and a ceiling exist
    (not so for a perplexity or an output perturbation)."""
    if kind not in KINDS:
        raise ValueError(f"claim kind {kind!r}: expected one of {KINDS}")
    a, b = s["a_acc"], s["b_acc"]
    if bounded and a <= FLOOR and b <= FLOOR:
        return "uninformative", f"both arms <= {FLOOR:.0%}"
    if bounded and kind == "better" and a >= CEILING and b >= CEILING:
        return "uninformative", f"both arms >= {CEILING:.0%}"
    if kind == "better":
        if p_holm < ALPHA:
            return (("holds", "a wins") if s["a_wins"] > s["b_wins"]
                    else ("does not hold", "b wins"))
        return "cannot tell", f"p_holm {p_holm:.2g} >= {ALPHA}"
    pts = round(100 * margin)
    if s["diff_lo"] > -margin:
        return "holds", f"a - b >= {s['diff_lo']:+.0%} > -{pts} points"
    if s["diff_hi"] < -margin:
        return "does not hold", f"a - b <= {s['diff_hi']:+.0%} < -{pts} points"
    return "cannot tell", f"margin {pts} points not excluded (a - b down to {s['diff_lo']:+.0%})"


def spec(method: str, params: dict) -> str:
    """`name[key=value,...]` of a method with its non-default parameters (sorted)."""
    if not params:
        return method
    return method + "[" + ",".join(f"{k}={params[k]}" for k in sorted(params)) + "]"


def _same_length(a, b) -> None:
    if len(a) != len(b) or not len(a):
        raise ValueError(f"paired scores need equal, non-zero lengths: got {len(a)} and {len(b)}")


# -- the registry: docs/results/claims.jsonl, one line a comparison, from the records --

KEY_FIELDS = ("method", "method_params", "budget", "ratio", "scenario", "task",
              "context_length", "seed", "samples")
# the metrics a row may compare, each with the fields that name its records and how a
# record gives its paired units (samples, or text blocks), higher better
METRICS = {
    "accuracy": KEY_FIELDS,  # a sweep's record: its samples' scores (`details`)
    "nll": ("label", "rho", "text", "tokens", "prompt", "span"),  # minus each block's NLL
    "perturbation": ("base", "critical", "budget", "sample", "set", "task", "context",
                     "seed"),  # minus one sample's sum over layers of `arm`
}


def record_key(r: dict, metric: str = "accuracy") -> dict:
    """What names one record in its file: the fields a comparison pairs it by."""
    return {k: r.get(k) for k in METRICS[metric]}


def units(records: list[dict], metric: str, arm: str | None = None) -> list[float]:
    """The paired units of `records`, higher better: each sample's score (accuracy),
    minus each block's mean NLL (a perplexity run), minus a sample's output perturbation
    summed over layers (`arm`: e.g. "question_critical")."""
    if metric == "nll":
        return [-x for r in records for x in r["nll_blocks"]]
    if metric == "perturbation":
        return [-sum(r[arm]) for r in records]
    raise ValueError(f"metric {metric!r}: units of {sorted(METRICS)}")


def find(records: list[dict], key: dict, metric: str = "accuracy") -> dict:
    """The one record of `records` whose `record_key` is `key`."""
    hits = [r for r in records if record_key(r, metric) == key]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} records match {key}: expected exactly one")
    return hits[0]


def paired_scores(ra: dict, rb: dict) -> tuple[list[float], list[float]]:
    """The per-sample scores of two records of the same prompts, in sample order; raises
    where the samples differ (other answers or needle depths: not the same prompts)."""
    da, db = ra.get("details") or [], rb.get("details") or []
    if len(da) != len(db) or not da:
        raise ValueError(f"{ra['method']} and {rb['method']}: {len(da)} and {len(db)} "
                         "per-sample details; a paired test needs the same samples (--details)")
    for i, (x, y) in enumerate(zip(da, db)):
        if (x.get("answer"), x.get("depth")) != (y.get("answer"), y.get("depth")):
            raise ValueError(f"{ra['method']} and {rb['method']}: sample {i} differs "
                             f"({x.get('answer')} vs {y.get('answer')}): not the same prompts")
    return [x["score"] for x in da], [y["score"] for y in db]


def is_binary(scores: list[float]) -> bool:
    return all(s in (0.0, 1.0) for s in scores)


def scores_of(rows_a: list[dict], rows_b: list[dict]) -> tuple[list[float], list[float]]:
    """Paired scores over one or more (a, b) record pairs (a claim averaged over tasks
    pools their samples)."""
    a, b = [], []
    for ra, rb in zip(rows_a, rows_b, strict=True):
        x, y = paired_scores(ra, rb)
        a += x
        b += y
    return a, b


def judge(rows: list[dict]) -> list[dict]:
    """Holm over each (paper, model)'s comparisons, then each row's verdict and reason:
    `rows` carry `compare`'s statistics and `paper`, `model`, `kind`, `margin`."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r["paper"], r["model"]), []).append(i)
    out = [dict(r) for r in rows]
    for idx in groups.values():
        for i, q in zip(idx, holm([rows[i]["p"] for i in idx])):
            out[i]["p_holm"] = q
            out[i]["verdict"], out[i]["reason"] = verdict(
                out[i]["kind"], out[i], q, out[i].get("margin") or MARGIN,
                bounded=out[i].get("metric", "accuracy") in ("accuracy", "score"))
    return out


def recompute(row: dict, root) -> dict:
    """`compare`'s statistics of a registry row, from the records files it names."""
    from pathlib import Path

    from kvjax import report

    records = {f: report.load_records(Path(root) / f) for f in row["records"]}
    pool = [r for f in row["records"] for r in records[f]]
    metric = row.get("metric", "accuracy")
    kind = "accuracy" if metric in ("accuracy", "score") else metric
    ra = [find(pool, k, kind) for k in row["a_records"]]
    rb = [find(pool, k, kind) for k in row["b_records"]]
    if kind == "accuracy":
        a, b = scores_of(ra, rb)
        return compare(a, b, is_binary(a + b))
    return compare(units(ra, kind, row.get("a_arm")), units(rb, kind, row.get("b_arm")),
                   binary=False)
