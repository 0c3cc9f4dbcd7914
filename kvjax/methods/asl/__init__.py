"""ASL (adaptive selection layer) and the layer-wise baselines of its tables, FastKV and
GemFilter: tokens selected at one prefill layer, deeper layers run on them
(`prefill_kind = "token_selection"`, the engine's `kvjax.engine.token_selection`)."""

from kvjax.methods.asl.selection_layer import (  # noqa: F401
    ASL,
    ASL2Pass,
    ASLFullBefore,
    FastKV,
    GemFilter,
)
