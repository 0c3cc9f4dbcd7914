"""`compact`: gather each head's kept rows of K, V and positions into fixed-capacity slots.

`idx` holds, per (batch, KV head), the kept source rows in slot order (ascending, from
`lax.top_k` then a sort: `kvjax.compression.selection.top_with_window`); the first
`count` slots are live. Dead slots come back as zeros with `valid` False, so that a
masked attention multiplying them by 0 never meets NaN.
"""

from __future__ import annotations

from jaxtyping import Array, Int

from kvjax.pallas import dispatch
from kvjax.pallas.ops.compact import pallas_gpu, pallas_tpu, xla


def compact(
    k_BKTD: Array,
    v_BKTD: Array,
    pos_BKT: Int[Array, "B K T"],
    idx_BKS: Int[Array, "B K S"],
    count_BK: Int[Array, "B K"],
    *,
    rows: int | None = None,
    implementation: str | None = None,
    interpret: bool = False,
):
    """-> (k [B, K, S, D], v [B, K, S, D], pos [B, K, S], valid [B, K, S]). `rows`: slots
    per kernel step (16 on TPU, 32 on GPU)."""
    if k_BKTD.dtype != v_BKTD.dtype or k_BKTD.shape != v_BKTD.shape:
        raise ValueError("k and v must have the same shape and dtype")
    rows_of = {"pallas_tpu": rows or 16, "pallas_gpu": rows or 32}
    impl, interp = dispatch.pick("compact", implementation, interpret, {
        "pallas_tpu": pallas_tpu.reason(idx_BKS, rows_of["pallas_tpu"]),
        "pallas_gpu": pallas_gpu.reason(k_BKTD, rows_of["pallas_gpu"]),
    })
    if impl == "xla":
        return xla.compact(k_BKTD, v_BKTD, pos_BKT, idx_BKS, count_BK)
    mod = pallas_tpu if impl == "pallas_tpu" else pallas_gpu
    return mod.compact(k_BKTD, v_BKTD, pos_BKT, idx_BKS, count_BK, rows=rows_of[impl],
                       interpret=interp)
