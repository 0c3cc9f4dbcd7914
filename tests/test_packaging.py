"""Method configs ship inside the package: an installed wheel has the same defaults as the
checkout (they once lived outside the package, and a wheel install silently changed them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "kvjax" / "configs" / "methods"

# in a process whose only kvjax is the unpacked wheel: every registered method's config as
# the registry reads it (importlib.resources), and where kvjax was imported from
_PROBE = """
import json, kvjax
from kvjax.methods import registry
print(json.dumps({"file": kvjax.__file__,
                  "configs": {n: registry.config(n) for n in registry.names()}}))
"""


def _wheel(tmp: Path) -> Path:
    """A wheel built from a copy of the sources, as `pip wheel` builds it (the bundled
    model's weights are left out of the copy: they are not what this checks, and copying
    them is most of the time)."""
    src = tmp / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    shutil.copytree(ROOT / "kvjax", src / "kvjax",
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (whl,) = (tmp / "dist").glob("kvjax-*.whl")
    return whl


def test_wheel_ships_every_method_config(tmp_path):
    whl = _wheel(tmp_path)
    names = set(zipfile.ZipFile(whl).namelist())
    yamls = sorted(CONFIGS.glob("*.yaml"))
    assert len(yamls) > 20
    missing = [f.name for f in yamls if f"kvjax/configs/methods/{f.name}" not in names]
    assert not missing, f"method configs missing from the wheel: {missing}"

    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    got = json.loads(out.splitlines()[-1])
    assert Path(got["file"]).is_relative_to(site), got["file"]  # not the checkout
    for name, params in got["configs"].items():
        f = CONFIGS / f"{name}.yaml"
        want = yaml.safe_load(f.read_text()) if f.exists() else {}
        want = (want or {}).get("params", want) or {}
        assert params == json.loads(json.dumps(want)), name
    assert {f.stem for f in yamls} <= set(got["configs"])  # every file is a method's
    assert got["configs"]["snapkv"]["window"] == 32  # (not an empty read everywhere)
