"""`value_norms`: CriticalKV's ||V_i W_O^h||_1 per entry, mean over each KV head's G query
heads, computed blockwise without materialising V W_O ([n, hidden] per head)."""

from __future__ import annotations

from jaxtyping import Array, Float

from kvjax.pallas import dispatch
from kvjax.pallas.ops.value_norms import pallas_gpu, pallas_tpu, xla


def value_norms(
    v_BKTD: Float[Array, "B K T Dh"],
    o_HDM: Float[Array, "HDh M"],
    *,
    block: int = 256,
    tile: int | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "B K T"]:
    """`o`: one layer's output projection [H * Dh, hidden] (the model's `o` param). `block`:
    tokens per step of the xla reference; `tile`: tokens per TPU step (512) or hidden
    columns per GPU step (128)."""
    B, K, T, Dh = v_BKTD.shape
    if o_HDM.shape[0] % (K * Dh):
        raise ValueError(f"o has {o_HDM.shape[0]} rows, not a multiple of K * Dh = {K * Dh}")
    tiles = {"pallas_tpu": tile or 512, "pallas_gpu": tile or 128}
    impl, interp = dispatch.pick("value_norms", implementation, interpret, {
        "pallas_tpu": pallas_tpu.reason(v_BKTD, o_HDM, tiles["pallas_tpu"]),
        "pallas_gpu": pallas_gpu.reason(v_BKTD, o_HDM, tiles["pallas_gpu"]),
    })
    if impl == "xla":
        return xla.value_norms(v_BKTD, o_HDM, block=block)
    if impl == "pallas_tpu":
        return pallas_tpu.value_norms(v_BKTD, o_HDM, tile=tiles[impl], interpret=interp)
    return pallas_gpu.value_norms(v_BKTD, o_HDM, hidden=tiles[impl], interpret=interp)
