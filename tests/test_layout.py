"""The package's import graph: the kernel ops are a leaf under the compression package."""

import ast
from pathlib import Path

KVJAX = Path(__file__).resolve().parents[1] / "kvjax"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_pallas_imports_nothing_of_the_compression_package():
    """Each op's reference owns its math (window scores, the slot gather); the compression
    package calls the ops, never the reverse (docs/design.md, "Kernels")."""
    bad = {str(p.relative_to(KVJAX)): sorted(m for m in _imports(p)
                                             if m.startswith(("kvjax.compression",
                                                              "kvjax.methods", "kvjax.engine")))
           for p in (KVJAX / "pallas").rglob("*.py")}
    assert not {p: m for p, m in bad.items() if m}, bad
