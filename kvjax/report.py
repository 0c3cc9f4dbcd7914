"""Tables and plots of `python -m kvjax.run` records, for docs/results and the model card.

Every number a table shows comes from a record measured by `kvjax.run`; this module only
arranges them.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Callable, Iterable


def load_records(*paths: str | Path) -> list[dict]:
    """The records of `kvjax.run` outputs, in order: a JSON object `{"records": [...]}`
    (`--output x.json`, and every file under docs/results) or JSON lines, one record a
    line (`--output x.jsonl`)."""
    out = []
    for p in paths:
        out += _records(Path(p))
    return out


def _records(path: Path) -> list[dict]:
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # several lines: JSON lines
    if isinstance(data, dict) and "records" in data:
        return data["records"]
    from kvjax.tasks.loaders import read_jsonl

    return [r for _, r in read_jsonl(path)]


PREDICTION_FIELDS = ("line", "id", "dataset", "prediction", "score")


def predictions(r: dict) -> list[dict]:
    """A benchmark record's predictions (file line, id, dataset, prediction, score a
    sample): its `predictions`, or where it has details (`--details`) theirs."""
    if r.get("predictions") is not None:
        return r["predictions"]
    return sample_predictions(r["details"])


def sample_predictions(details: list[dict]) -> list[dict]:
    """The prediction fields of each sample's details (what `predictions` holds)."""
    return [{k: d[k] for k in PREDICTION_FIELDS} for d in details]


def is_complete(path: str | Path) -> bool:
    """Whether a `kvjax.run` output holds every record its command asked for. A JSON
    output says so (`"complete"`; files older than the field were written only when
    complete); a JSON-lines output cannot tell, so it counts as incomplete and is resumed
    (`--resume` skips what it holds)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return False
    return bool(json.loads(path.read_text()).get("complete", True))


def pivot(records: Iterable[dict], row: Callable[[dict], object], col: Callable[[dict], object],
          value: Callable[[dict], float]) -> tuple[list, list, dict]:
    """(rows, columns, {(row, column): value}) in first-seen order. Two records in one cell
    are refused: a table shows one measurement per cell, never whichever came last."""
    rows, cols, cells = [], [], {}
    for r in records:
        a, b = row(r), col(r)
        if (a, b) in cells:
            raise ValueError(f"two records for row {a!r}, column {b!r}: the table's row and "
                             "column keys must tell every record apart (add the budget, "
                             "context or scenario that differs)")
        rows += [a] if a not in rows else []
        cols += [b] if b not in cols else []
        cells[a, b] = value(r)
    return rows, cols, cells


def markdown_table(records: Iterable[dict], row, col, value, fmt: str = "{:.2f}",
                   row_name: str = "", mean_col: bool = False) -> str:
    """A markdown table: one row per `row(record)`, one column per `col(record)`."""
    rows, cols, cells = pivot(records, row, col, value)
    head = [row_name, *map(str, cols)] + (["mean"] if mean_col else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in rows:
        vals = [cells.get((a, b)) for b in cols]
        txt = [fmt.format(v) if v is not None else "-" for v in vals]
        if mean_col:
            got = [v for v in vals if v is not None]
            txt.append(fmt.format(sum(got) / len(got)) if got else "-")
        lines.append("| " + " | ".join([str(a), *txt]) + " |")
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


# Line styles: 10 colours, 7 marker shapes and 4 dash patterns cycle together, so series i
# and j share all three only when i = j mod 140, and neighbours differ in all three. Markers
# are hollow and of three sizes: two series on the same points show both shapes nested, and
# two identical curves still show both dash patterns.
_COLORS = tuple(f"C{i}" for i in range(10))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_DASHES = ("-", "--", "-.", ":")
_SIZES = (8, 6, 4.5)


def line_style(i: int) -> dict:
    """matplotlib `plot` keywords of the i-th series: colour, marker and dash pattern all
    cycle, so lines that coincide stay told apart (`plot_lines`, results overview)."""
    color = _COLORS[i % len(_COLORS)]
    return {"color": color, "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _DASHES[i % len(_DASHES)], "markersize": _SIZES[i % len(_SIZES)],
            "markerfacecolor": "none", "markeredgecolor": color, "markeredgewidth": 1.3,
            "linewidth": 1.4}


def plot_lines(records: Iterable[dict], series, x, y, path: str | Path, xlabel: str, ylabel: str,
               title: str = "", logx: bool = False) -> Path | None:
    """One line per `series(record)` of y against x, each with its own colour, marker and
    dash pattern (`line_style`); None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    rows, cols, cells = pivot(records, series, x, y)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, s in enumerate(rows):
        pts = sorted((c, cells[s, c]) for c in cols if (s, c) in cells)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=str(s), **line_style(i))
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion k/n (k may be a sum of fractional
    scores). A difference between two accuracies whose intervals overlap is a tie."""
    if n <= 0:
        raise ValueError(f"wilson: n must be positive, got {n}")
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / den
    return max(0.0, mid - half), min(1.0, mid + half)


def replace_section(doc: str | Path, marker: str, body: str) -> None:
    """Replace the text between `<!-- marker -->` and `<!-- /marker -->` in a file."""
    path = Path(doc)
    text = path.read_text()
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} section")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{body}\n{end}{tail}")


def write_page(path: str | Path, text: str) -> None:
    """Write a results page a script renders whole, keeping the real models' sections
    another script renders into it (`<!-- smollm2-... -->` ... `<!-- /smollm2-... -->`,
    `<!-- qwen-... -->`, by `scripts/smollm2_results.py`) right after the new text's title
    line."""
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    kept = re.findall(r"(## [^\n]*\n\n<!-- ((?:smollm2|qwen)-[\w-]+) -->.*?<!-- /\2 -->\n)",
                      old, re.S)
    if kept:
        title, _, rest = text.partition("\n")
        text = title + "\n\n" + "\n".join(k for k, _ in kept) + "\n## On tiny-retrieval " \
            "(earlier; not a language model)\n" + rest
    path.write_text(text)


def results_parser(doc: str | None, out: Path, samples: int = 50) -> argparse.ArgumentParser:
    """The arguments every results script shares (model, samples, seed, output folder)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-retrieval")
    p.add_argument("--samples", type=int, default=samples)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=out)
    return p


def record_weights(r: dict) -> tuple:
    """(sha256, trained_steps) of a record (`kvjax.cli.schema.Weights`); (None, None) for
    records older than the field."""
    from kvjax.cli.schema import Weights

    w = Weights.of(r)
    return w.sha256, w.trained_steps


def model_line(records: Iterable[dict]) -> str:
    """The weights a set of records was measured on, for a results document's header;
    records of different weights in one document are refused."""
    seen = {(r["model"], *record_weights(r)) for r in records}
    if len(seen) != 1:
        raise ValueError(f"records of {len(seen)} different models or weights {sorted(seen, key=str)}: "
                         "re-measure them on one")
    name, sha, steps = seen.pop()
    if sha is None:
        return f"model {name} (its weights were not recorded)"
    return f"model {name}" + (f" at trained step {steps}" if steps is not None else "") + \
        f", weights sha256 {sha[:12]}"


def _weights_of(args: list[str]) -> str | None:
    from kvjax.api import model_dir
    from kvjax.models.checkpoint import weights_sha256

    name = args[args.index("--model") + 1] if "--model" in args else "tiny-retrieval"
    return weights_sha256(model_dir(name))


def run_once(path: Path, args: list[str], cwd: Path) -> Path:
    """`python -m kvjax.run <args> --output path`, unless `path` exists, is complete and
    was measured on the same weights (delete it to re-measure). An interrupted sweep's
    output (every finished record is kept) is resumed with `--resume`; records of other
    weights are never reused."""
    import subprocess
    import sys

    resume = []
    if path.exists():
        got = {record_weights(r)[0] for r in load_records(path)}
        want = _weights_of(args)
        if got - {want}:
            raise ValueError(f"{path} holds records of weights {sorted(got, key=str)}, not of "
                             f"the model's current weights {want}: delete it to re-measure")
        if is_complete(path):
            print(f"{path} exists: not re-running", file=sys.stderr)
            return path
        print(f"{path} is incomplete: resuming", file=sys.stderr)
        resume = ["--resume"]
    print("kvjax.run " + " ".join(args), file=sys.stderr)
    subprocess.run([sys.executable, "-m", "kvjax.run", *args, "--output", str(path), *resume],
                   check=True, cwd=cwd)
    return path


def method_label(r: dict) -> str:
    """Table row of a record: `full`, or `method @budget`."""
    return "full" if r["method"] == "full" else f"{r['method']} @{r['budget']}"
