"""LAVa (one score for heads and layers, entropy layer budgets, cascading prefill) and CAKE,
the layer-budget baseline of its tables; both on `cascade.Cascading`."""

from kvjax.methods.lava.cake import CAKE  # noqa: F401
from kvjax.methods.lava.entropy import (  # noqa: F401
    LAVa,
    LAVaCode,
    LAVaHeadBudgets,
    LAVaLayerBudgets,
)
