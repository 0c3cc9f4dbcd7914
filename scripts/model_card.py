"""Measure the bundled model's full-cache accuracy per task and write it into MODEL.md.

    python scripts/model_card.py --contexts 1024,2048 --samples 50

Runs `python -m kvjax.run --method full` over every task and context (question-aware) and
replaces the table between the `accuracy` markers of MODEL.md with what it measured: the
accuracy per task and context, the mean over the retrieval tasks, and that mean by the
depth of the (first) needle, which says whether a miss is a matter of distance.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import report, tasks  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", default="1024,2048")
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--model", default="tiny-retrieval")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "card.json"
        cmd = [sys.executable, "-m", "kvjax.run", "--model", a.model, "--method", "full",
               "--task", ",".join(tasks.names()), "--context", a.contexts,
               "--samples", str(a.samples), "--details", "--output", str(out)]
        subprocess.run(cmd, check=True, cwd=ROOT)
        records = json.loads(out.read_text())["records"]
    kinds = {n: tasks.get(n).kind for n in tasks.names()}
    table = report.markdown_table(records, lambda r: r["task"], lambda r: r["context_length"],
                                  lambda r: 100 * r["accuracy"], fmt="{:.0f}", row_name="task")
    # one mean per context over the retrieval tasks (a table cell holds one record)
    retrieval = [r for r in records if kinds[r["task"]] == "retrieval"]
    contexts = sorted({r["context_length"] for r in retrieval})
    mean = [{"context_length": c, "accuracy": float(np.mean(
        [r["accuracy"] for r in retrieval if r["context_length"] == c]))} for c in contexts]
    means = report.markdown_table(mean, lambda r: "retrieval mean",
                                  lambda r: r["context_length"], lambda r: 100 * r["accuracy"],
                                  fmt="{:.1f}")
    by_depth = report.markdown_table(depth_bins(retrieval), lambda r: r["depth"],
                                     lambda r: r["context_length"], lambda r: 100 * r["accuracy"],
                                     fmt="{:.0f}", row_name="needle depth")
    cmdline = " ".join(["python -m kvjax.run", *cmd[3:]]).replace(str(out), "card.json")
    body = (f"Measured by `python scripts/model_card.py --contexts {a.contexts} --samples "
            f"{a.samples}` (i.e. `{cmdline}`); {report.model_line(records)}; accuracy in %, "
            f"{a.samples} samples per cell, question-aware, needle depths spread evenly."
            f"\n\n{table}\n"
            + "\n".join(means.splitlines()[2:]).replace("| retrieval mean", "| **retrieval mean**")
            + "\n\nThe retrieval mean by the depth of the needle (0 = the start of the context, "
            f"farthest from the question), over all retrieval tasks:\n\n{by_depth}")
    report.replace_section(ROOT / "MODEL.md", "accuracy", body)
    print(body)
    return 0


def depth_bins(records: list[dict], bins: int = 5) -> list[dict]:
    """One record per (context, depth range): the accuracy over every sample of `records`
    whose needle lies in that range (`kvjax.run --details` records each sample's depth)."""
    scores: dict[tuple, list] = {}
    for r in records:
        for d in r["details"]:
            b = min(int(d["depth"] * bins), bins - 1)
            scores.setdefault((r["context_length"], b), []).append(d["score"])
    return [{"context_length": c, "depth": f"{b / bins:.1f}-{(b + 1) / bins:.1f}",
             "accuracy": float(np.mean(v))} for (c, b), v in sorted(scores.items())]


if __name__ == "__main__":
    raise SystemExit(main())
