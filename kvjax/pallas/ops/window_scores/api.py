"""`window_scores`: the pooled window attention score of every prefix column, per KV head.

Conventions (docs/methods.md, "Conventions"; `xla.snap_scores` is the
reference): the last
`window` queries attend, softmax in fp32 at 1/sqrt(d) over every key each sees (prefix
and, causally, the window); the prefix columns [0, T - window) are reduced over the
window (`reduce`: sum or mean), pooled per query head (stride 1, `kernel // 2` padding;
avg counts the padding, max pads -inf), then reduced over the G query heads of each KV
head (`gqa`: mean, sum, max). Padding columns score 0.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float

from kvjax.pallas.ops.window_scores.xla import GQA_REDUCTIONS, POOLINGS, WINDOW_REDUCTIONS
from kvjax.pallas import dispatch
from kvjax.pallas.ops.window_scores import pallas_gpu, pallas_tpu, xla


def window_scores(
    q_BTHD: Float[Array, "B T H D"],
    k_BKTD: Float[Array, "B K T D"],
    valid_BT: Bool[Array, "B T"],
    *,
    window: int,
    kernel: int = 7,
    pooling: str = "max",
    gqa: str = "mean",
    reduce: str = "mean",
    tile: int | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "B K P"]:
    """[B, K, T - window] float32 scores. `tile`: key columns per kernel step (default
    512 on TPU, 128 on GPU)."""
    T = q_BTHD.shape[1]
    if not 1 <= window <= T:
        raise ValueError(f"window={window} must be in [1, {T}]")
    if pooling not in POOLINGS or gqa not in GQA_REDUCTIONS or reduce not in WINDOW_REDUCTIONS:
        raise ValueError(f"pooling={pooling!r}, gqa={gqa!r}, reduce={reduce!r}; allowed: "
                         f"{POOLINGS}, {GQA_REDUCTIONS}, {WINDOW_REDUCTIONS}")
    if pooling != "none" and (kernel < 1 or kernel % 2 == 0):
        raise ValueError(f"pooling kernel={kernel} must be a positive odd integer")
    kw = dict(window=window, kernel=kernel, pooling=pooling, gqa=gqa, reduce=reduce)
    tiles = {"pallas_tpu": tile or 512, "pallas_gpu": tile or 128}
    impl, interp = dispatch.pick("window_scores", implementation, interpret, {
        "pallas_tpu": pallas_tpu.reason(q_BTHD, k_BKTD, window, kernel, tiles["pallas_tpu"]),
        "pallas_gpu": pallas_gpu.reason(q_BTHD, k_BKTD, window, kernel, tiles["pallas_gpu"]),
    })
    if impl == "xla" or window == T:
        return xla.window_scores(q_BTHD, k_BKTD, valid_BT, **kw)
    mod = pallas_tpu if impl == "pallas_tpu" else pallas_gpu
    return mod.window_scores(q_BTHD, k_BKTD, valid_BT, **kw, tile=tiles[impl], interpret=interp)
