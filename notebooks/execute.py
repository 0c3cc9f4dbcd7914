"""Run notebooks' code cells top to bottom, each notebook in a fresh interpreter, and save
them with their outputs (printed text, matplotlib figures, the value of a cell's last
expression), as Jupyter would.

    python notebooks/execute.py notebooks/*.ipynb            # run, then save each in place
    python notebooks/execute.py --check notebooks/quickstart.ipynb   # run only (the tests)

No Jupyter is needed: the cells are plain Python (no `!` or `%` lines), run in one
namespace with the notebook's folder as the working directory, so what runs here runs
in Colab and Jupyter. A cell that raises stops the run with exit status 1, and nothing is
saved.
"""

from __future__ import annotations

import argparse
import ast
import base64
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path


class _Outputs:
    """The outputs of the cell being run, in nbformat's shape; consecutive text of one
    stream is one output."""

    def __init__(self):
        self.items: list[dict] = []

    def text(self, name: str, s: str) -> None:
        if not s:
            return
        if self.items and self.items[-1].get("name") == name:
            self.items[-1]["text"] += s
        else:
            self.items.append({"output_type": "stream", "name": name, "text": s})

    def png(self, data: bytes) -> None:
        self.items.append({"output_type": "display_data", "metadata": {},
                           "data": {"image/png": base64.b64encode(data).decode(),
                                    "text/plain": "<Figure>"}})


class _Stream(io.TextIOBase):
    def __init__(self, outputs: _Outputs, name: str, echo):
        self.outputs, self.name, self.echo = outputs, name, echo

    def write(self, s: str) -> int:
        self.outputs.text(self.name, s)
        self.echo.write(s)
        return len(s)

    def flush(self) -> None:
        self.echo.flush()


def _figures(outputs: _Outputs) -> None:
    """Every open matplotlib figure into the outputs, then closed (Jupyter's inline
    backend shows the figures a cell leaves open, and `plt.show()` shows them at once)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", dpi=90, bbox_inches="tight")
        outputs.png(buf.getvalue())
    plt.close("all")


def _run_cell(src: str, ns: dict, name: str):
    """Run a cell's code in `ns`; the value of its last line when that is an expression."""
    tree = ast.parse(src, filename=name)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, name, "exec"), ns)
    return None if last is None else eval(compile(last, name, "eval"), ns)


def _pyplot(current: list) -> None:
    """Import pyplot on the file-only backend, with `plt.show()` putting the open figures
    into the outputs of the cell being run (as Jupyter's inline backend does)."""
    os.environ["MPLBACKEND"] = "Agg"
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    plt.show = lambda *_a, **_k: _figures(current[0])


def run(path: Path) -> dict:
    """The notebook with every code cell run and its outputs filled in; raises on the
    first error (after printing the cell's traceback)."""
    nb = json.loads(path.read_text())
    os.chdir(path.parent)
    current: list = [None]
    _pyplot(current)
    ns: dict = {"__name__": "__main__"}
    count = 0
    t_start = time.perf_counter()
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        count += 1
        src = "".join(cell["source"])
        outputs = current[0] = _Outputs()
        out, err = sys.stdout, sys.stderr
        sys.stdout = _Stream(outputs, "stdout", out)
        sys.stderr = _Stream(outputs, "stderr", err)
        t0 = time.perf_counter()
        try:
            value = _run_cell(src, ns, f"{path.name}, code cell {count}")
            _figures(outputs)
        except BaseException:
            sys.stdout, sys.stderr = out, err
            print(f"{path.name}: code cell {count} failed:\n{src}\n", file=sys.stderr)
            traceback.print_exc()
            raise
        finally:
            sys.stdout, sys.stderr = out, err
        if value is not None:
            outputs.items.append({"output_type": "execute_result", "execution_count": count,
                                  "metadata": {}, "data": {"text/plain": repr(value)}})
        cell["execution_count"] = count
        cell["outputs"] = outputs.items
        print(f"[{path.name}] cell {count}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"[{path.name}] all cells: {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    return nb


def _one(path: Path, check: bool) -> int:
    """Run one notebook in this interpreter; save it unless `check`."""
    try:
        nb = run(path)
    except BaseException:
        return 1
    if not check:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print(f"saved {path}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--check", action="store_true", help="run only; save nothing")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.in_process:
        return _one(a.notebooks[0].resolve(), a.check)
    rc = 0
    for nb in a.notebooks:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--in-process", str(nb.resolve())]
        rc |= subprocess.run(cmd + (["--check"] if a.check else []), check=False).returncode
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
