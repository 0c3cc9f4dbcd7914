"""The reference: `kvjax.models.attention.attend` with T = 1 (holds [B, H, S] probabilities)."""

from __future__ import annotations

from jaxtyping import Array, Bool, Float

from kvjax.models import attention
from kvjax.pallas.dispatch import default_implementation


def decode_attention(
    q_BHD: Float[Array, "B H D"],
    k_BKSD: Float[Array, "B K S D"],
    v_BKSD: Float[Array, "B K S D"],
    ok_BKS: Bool[Array, "B K S"],
) -> Float[Array, "B H D"]:
    with default_implementation("xla"):  # `attend` itself dispatches decode to this op
        return attention.attend(q_BHD[:, None], k_BKSD, v_BKSD, ok_BKS[:, :, None])[:, 0]
