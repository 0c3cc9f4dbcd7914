"""The method registry: names (`--method`) to configured method instances.

A method's defaults are its dataclass defaults, overridden by its config file
(`kvjax/configs/methods/<name>.yaml`, shipped inside the package), then by the caller's
overrides. A wrapper (a method whose field `base` is another method, such as CriticalKV)
is registered under a name of its own with the name of its base: its config file says
`base: <name>`, the base is built from that name's defaults, and an override goes to the
wrapper when it is one of the wrapper's fields and to the base otherwise.
"""

from __future__ import annotations

import dataclasses
from importlib import resources

import yaml

from kvjax.compress.method import Method

_CLASSES: dict[str, type[Method]] = {}
_WRAPPED: dict[str, tuple[type[Method], str]] = {}  # name -> (wrapper class, base name)


def register(cls: type[Method]) -> type[Method]:
    if cls.name in _CLASSES or cls.name in _WRAPPED:
        if _CLASSES.get(cls.name) is not cls:
            raise ValueError(f"method name {cls.name!r} registered twice")
    _CLASSES[cls.name] = cls
    return cls


def register_wrapped(name: str, wrapper: type[Method], base: str) -> None:
    """Register `wrapper(base=<the method named base>)` under `name`."""
    if name in _CLASSES or (name in _WRAPPED and _WRAPPED[name] != (wrapper, base)):
        raise ValueError(f"method name {name!r} registered twice")
    _WRAPPED[name] = (wrapper, base)


def names() -> list[str]:
    return sorted([*_CLASSES, *_WRAPPED])


def get(name: str) -> type[Method]:
    """The class of a registered name (a wrapper's class for a wrapped name)."""
    if name in _CLASSES:
        return _CLASSES[name]
    if name in _WRAPPED:
        return _WRAPPED[name][0]
    raise ValueError(f"unknown method {name!r}; registered methods: {', '.join(names())}")


def config(name: str) -> dict:
    """The config-file defaults of a method (empty when it has no config file)."""
    f = resources.files("kvjax") / "configs" / "methods" / f"{name}.yaml"
    if not f.is_file():
        return {}
    data = yaml.safe_load(f.read_text()) or {}
    return data.get("params", data) or {}


def fields_of(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def parameters(name: str) -> dict[str, dataclasses.Field]:
    """Every parameter `create(name, ...)` accepts (a wrapper's and its base's)."""
    get(name)
    if name in _WRAPPED:
        wrapper, base = _WRAPPED[name]
        return {**parameters(base), **{k: f for k, f in fields_of(wrapper).items() if k != "base"}}
    return fields_of(_CLASSES[name])


def create(name: str, **overrides) -> Method:
    """A method by name: dataclass defaults < the config file < overrides."""
    get(name)
    allowed = parameters(name)
    kwargs = {**config(name), **overrides}
    bad = sorted(set(kwargs) - set(allowed))
    if bad:
        raise ValueError(f"method {name!r} has no parameter(s) {bad}; parameters: "
                         f"{sorted(allowed)}")
    if name in _CLASSES:
        return _CLASSES[name](**kwargs)
    wrapper, base = _WRAPPED[name]
    own = {k for k in fields_of(wrapper) if k != "base"}
    return wrapper(base=create(base, **{k: v for k, v in kwargs.items() if k not in own}),
                   **{k: v for k, v in kwargs.items() if k in own})
