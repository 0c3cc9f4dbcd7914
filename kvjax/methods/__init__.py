"""Compression methods, one folder per family, and the registry that names them.

| folder            | methods                                                            |
| ----------------- | ------------------------------------------------------------------ |
| `baselines/`      | snapkv, pyramidkv, ada_snapkv, ada_pyramidkv, headkv, streaming_llm,|
|                   | tova, h2o, observed_attention (what the papers compare against)    |
| `asl/`            | asl, asl_full_before, asl_2pass, fastkv, gemfilter                 |
| `slim/`           | sliminfer, sliminfer_restrict, sliminfer_aggressive, lazyllm       |
| `lava/`           | lava, lava_code, lava_heads_only, lava_layers_only, cake           |
| `critical/`       | critical_snapkv, critical_pyramidkv, critical_adakv,               |
|                   | critical_headkv, critical_lava (the rule wraps a base)             |
| `d2o/`            | d2o, d2o_code, d2o_uniform_layers, d2o_no_merge, roco, cam         |

`full` (the uncompressed baseline) is the protocol's base class,
`kvjax.compression.method.Method`. Every method is a frozen dataclass; docs/methods.md gives
each one's equations, defaults and where the paper and the authors' code differ.
"""

from kvjax.compression.method import Method
from kvjax.methods.registry import config, create, get, names, parameters, register

register(Method)
Full = Method

# importing a family registers its methods
from kvjax.methods import asl, baselines, critical, d2o, lava, slim  # noqa: E402,F401
from kvjax.methods.asl import ASL, ASL2Pass, ASLFullBefore, FastKV, GemFilter  # noqa: E402
from kvjax.methods.baselines import (  # noqa: E402
    H2O,
    TOVA,
    AdaPyramidKV,
    AdaSnapKV,
    HeadKV,
    ObservedAttention,
    PyramidKV,
    SnapKV,
    StreamingLLM,
)
from kvjax.methods.critical import Critical  # noqa: E402
from kvjax.methods.d2o import D2O, CaM, D2OCode, RoCo  # noqa: E402
from kvjax.methods.lava import CAKE, LAVa  # noqa: E402
from kvjax.methods.slim import LazyLLM, SlimInfer  # noqa: E402

__all__ = ["Method", "Full", "register", "names", "get", "create", "config", "parameters",
           "ASL", "ASL2Pass", "ASLFullBefore", "FastKV", "GemFilter", "SnapKV", "PyramidKV",
           "AdaSnapKV", "AdaPyramidKV", "StreamingLLM", "TOVA", "H2O", "ObservedAttention",
           "SlimInfer", "LazyLLM", "LAVa", "CAKE", "Critical", "HeadKV", "D2O", "D2OCode",
           "RoCo", "CaM"]
