"""The reference: the model's masked attention with one query (holds [B, H, S] probabilities)."""

from __future__ import annotations

from jaxtyping import Array, Bool, Float

from kvjax.models import attention


def decode_attention(
    q_BHD: Float[Array, "B H D"],
    k_BKSD: Float[Array, "B K S D"],
    v_BKSD: Float[Array, "B K S D"],
    ok_BKS: Bool[Array, "B K S"],
) -> Float[Array, "B H D"]:
    return attention.attend(q_BHD[:, None], k_BKSD, v_BKSD, ok_BKS[:, :, None])[:, 0]
