"""Registry of compression methods: `names()`, `create(name, **overrides)`, `get(name)`.

A method's defaults are its dataclass defaults, overridden by `configs/methods/<name>.yaml`
when that file exists, then by the caller's overrides.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from kvjax.methods.base import Method

_REGISTRY: dict[str, type[Method]] = {}
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "methods"


def register(cls: type[Method]) -> type[Method]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type[Method]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; registered methods: {', '.join(names())}")
    return _REGISTRY[name]


def config(name: str) -> dict:
    """The YAML defaults of a method (empty when it has no config file)."""
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    return data.get("params", data)


def create(name: str, **overrides) -> Method:
    """A method by name: dataclass defaults < configs/methods/<name>.yaml < overrides."""
    cls = get(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {**config(name), **overrides}
    bad = sorted(set(kwargs) - fields)
    if bad:
        raise ValueError(f"method {name!r} has no parameter(s) {bad}; parameters: {sorted(fields)}")
    return cls(**kwargs)


register(Method)
Full = Method

# importing a family registers its methods
from kvjax.methods import asl  # noqa: E402,F401
from kvjax.methods.asl import ASL, ASL2Pass, ASLFullBefore, FastKV, GemFilter  # noqa: E402

from kvjax.methods import adakv, h2o, observed_attention, pyramidkv, snapkv, streaming_llm, tova  # noqa: E402,F401,I001
from kvjax.methods import cake, lava  # noqa: E402,F401,I001
from kvjax.methods.adakv import AdaPyramidKV, AdaSnapKV  # noqa: E402
from kvjax.methods.h2o import H2O  # noqa: E402
from kvjax.methods.observed_attention import ObservedAttention  # noqa: E402
from kvjax.methods.pyramidkv import PyramidKV  # noqa: E402
from kvjax.methods.snapkv import SnapKV  # noqa: E402
from kvjax.methods.streaming_llm import StreamingLLM  # noqa: E402
from kvjax.methods.tova import TOVA  # noqa: E402
from kvjax.methods import d2o  # noqa: E402,F401
from kvjax.methods.d2o import D2O, D2OCode  # noqa: E402
from kvjax.methods import critical  # noqa: E402,F401
from kvjax.methods import slim  # noqa: E402,F401
from kvjax.methods.slim import LazyLLM, SlimInfer  # noqa: E402

__all__ = ["Method", "Full", "register", "names", "get", "create", "config", "ASL",
           "ASL2Pass", "ASLFullBefore", "FastKV", "GemFilter", "SnapKV", "PyramidKV",
           "AdaSnapKV", "AdaPyramidKV", "StreamingLLM", "TOVA", "H2O", "ObservedAttention",
           "SlimInfer", "LazyLLM"]
from kvjax.methods import headkv  # noqa: E402,F401
from kvjax.methods.roco import RoCo  # noqa: E402,F401
from kvjax.methods.cam import CaM  # noqa: E402,F401
