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
import math
import re
import types
import typing
from importlib import resources

import yaml

from kvjax.compression.method import Method

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


def parameter_types(name: str) -> dict[str, object]:
    """The type annotation of every parameter `create(name, ...)` accepts."""
    get(name)
    if name in _WRAPPED:
        wrapper, base = _WRAPPED[name]
        own = {k: t for k, t in typing.get_type_hints(wrapper).items()
               if k in fields_of(wrapper) and k != "base"}
        return {**parameter_types(base), **own}
    cls = _CLASSES[name]
    return {k: t for k, t in typing.get_type_hints(cls).items() if k in fields_of(cls)}


def parse_value(name: str, key: str, text: str):
    """A `--set key=text` value typed against the method's dataclass field: an int field
    takes an integer and nothing else (not 2.5, true or null), a float field a finite
    number, a bool field true or false, an optional field also null, a tuple field a
    comma list. Raises ValueError naming the method, the field, its type and the value."""
    types_ = parameter_types(name)
    if key not in types_:
        raise ValueError(f"method {name!r} has no parameter {key!r}; parameters: "
                         f"{sorted(types_)}")
    tp = types_[key]
    if isinstance(tp, type) and issubclass(tp, Method):
        raise ValueError(f"--set {key}: a method is not set by value; pick the wrapped "
                         "method by name (e.g. critical_pyramidkv)")
    try:
        return _typed(text.strip(), tp)
    except ValueError:
        raise ValueError(f"--set {key}={text}: method {name!r} takes {key} as "
                         f"{_type_name(tp)}, got {text!r}") from None


_INT = re.compile(r"[+-]?\d+")
_NULL = ("null", "none", "~")


def _typed(text: str, tp):
    """`text` as a value of type `tp`; ValueError when it is not one."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in _NULL:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return _typed(text, a)
            except ValueError:
                pass
        raise ValueError(text)
    if tp is bool and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if tp is int and _INT.fullmatch(text):
        return int(text)
    if tp is float and math.isfinite(v := float(text) if _is_float(text) else math.nan):
        return v
    if tp is str:
        return text
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple(_typed(x.strip(), args[0]) for x in text.strip("[]()").split(","))
    if tp in (bool, int, float) or typing.get_origin(tp) is tuple:
        raise ValueError(text)
    return yaml.safe_load(text)  # a type without a rule here: YAML's


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _type_name(tp) -> str:
    names = {int: "an integer", float: "a finite number", bool: "true or false",
             str: "a string"}
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a)
                           for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        item = _type_name(typing.get_args(tp)[0]).removeprefix("an ").removeprefix("a ")
        return f"a comma list of {item}s (e.g. 8,4,2)"
    return names.get(tp, getattr(tp, "__name__", str(tp)))


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
