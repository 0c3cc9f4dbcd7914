"""`decode_attention`: one new query per head against the masked KV cache.

GQA (H = K * G query heads), `ok` the slots each KV head's queries may see (live, not in
the future, inside a sliding window: `kvjax.models.attention.mask` with T = 1), softmax
in fp32, output in the query dtype; a head with no live slot gets zeros, never NaN.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float

from kvjax.pallas import dispatch
from kvjax.pallas.ops.decode_attention import pallas_gpu, pallas_tpu, xla

GPU_BLOCKS = 264  # two blocks per SM of an H100 (132 SMs): splits = GPU_BLOCKS / (B*K)


def decode_attention(
    q_BHD: Float[Array, "B H D"],
    k_BKSD: Float[Array, "B K S D"],
    v_BKSD: Float[Array, "B K S D"],
    ok_BKS: Bool[Array, "B K S"],
    *,
    tile: int | None = None,
    splits: int | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "B H D"]:
    """`tile`: cache slots per kernel step (512 TPU, 128 GPU); `splits`: parts of the cache
    length run in parallel and merged at the end (2 on TPU, enough to fill a GPU)."""
    B, H, D = q_BHD.shape
    K = k_BKSD.shape[1]
    if H % K:
        raise ValueError(f"{H} query heads are not a multiple of {K} KV heads")
    tiles = {"pallas_tpu": tile or 512, "pallas_gpu": tile or 128}
    impl, interp = dispatch.pick("decode_attention", implementation, interpret, {
        "pallas_tpu": pallas_tpu.reason(q_BHD, k_BKSD, tiles["pallas_tpu"]),
        "pallas_gpu": pallas_gpu.reason(q_BHD, k_BKSD, tiles["pallas_gpu"]),
    })
    if impl == "xla":
        return xla.decode_attention(q_BHD, k_BKSD, v_BKSD, ok_BKS)
    if impl == "pallas_tpu":
        return pallas_tpu.decode_attention(q_BHD, k_BKSD, v_BKSD, ok_BKS, tile=tiles[impl],
                                           splits=splits or 2, interpret=interp)
    return pallas_gpu.decode_attention(q_BHD, k_BKSD, v_BKSD, ok_BKS, tile=tiles[impl],
                                       splits=splits or max(1, GPU_BLOCKS // (B * K)),
                                       interpret=interp)
