"""D2O (variance layer budgets, decode-time eviction with EMA-threshold merging) and the
merging/eviction baselines of its tables, RoCo and CaM."""

from kvjax.methods.d2o.cam import CaM  # noqa: F401
from kvjax.methods.d2o.discriminative import (  # noqa: F401
    D2O,
    D2OCode,
    D2ONoMerge,
    D2OUniformLayers,
)
from kvjax.methods.d2o.roco import RoCo  # noqa: F401
