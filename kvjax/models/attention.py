"""Masked grouped-query attention over a set of key slots.

One function serves prefill (keys = the prompt itself), chunked prefill on top of a
cache (context-only scenario) and decoding (T = 1): causality and budgets are both
expressed through slot positions and the `valid` mask, never through shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def mask(
    qpos_BT: Int[Array, "B T"],
    kpos_BKS: Int[Array, "B K S"],
    kvalid_BKS: Bool[Array, "B K S"],
    sliding_window: int | None = None,
) -> Bool[Array, "B K T S"]:
    """Which keys each query may see: live, not in its future, inside the sliding window."""
    q = qpos_BT[:, None, :, None]
    k = kpos_BKS[:, :, None, :]
    ok = kvalid_BKS[:, :, None, :] & (k <= q)
    if sliding_window is not None:
        ok &= q - k < sliding_window
    return ok


def logits(
    q_BTHD: Float[Array, "B T H D"], k_BKSD: Float[Array, "B K S D"]
) -> Float[Array, "B K G T S"]:
    """Scaled q.k in float32, query heads grouped by the KV head they share."""
    B, T, H, D = q_BTHD.shape
    K = k_BKSD.shape[1]
    G = H // K
    # one [G*T, D] x [D, S] matmul per (b, k): XLA:CPU runs this layout ~4x faster than a
    # dot_general with (g, t) as separate free dimensions
    q_BKMD = q_BTHD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, D)
    s = jnp.einsum("bkmd,bksd->bkms", q_BKMD, k_BKSD, preferred_element_type=jnp.float32)
    return s.reshape(B, K, G, T, -1) * (D**-0.5)


def softmax(s_BKGTS: Float[Array, "B K G T S"], ok_BKTS: Bool[Array, "B K T S"]):
    """Softmax over live keys; a row with no live key gives zeros, never NaN."""
    ok = ok_BKTS[:, :, None]
    s = jnp.where(ok, s_BKGTS, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    z = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(z > 0, z, 1.0)


def attend(
    q_BTHD: Float[Array, "B T H D"],
    k_BKSD: Float[Array, "B K S D"],
    v_BKSD: Float[Array, "B K S D"],
    ok_BKTS: Bool[Array, "B K T S"],
    return_probs: bool = False,
):
    """Attention output [B, T, H, D] (and, if asked, probabilities [B, K, G, T, S]).

    The dense reference; the engine routes one-query decoding to the `decode_attention`
    kernel op when the run's kernels pick one."""
    B, T, H, D = q_BTHD.shape
    p = softmax(logits(q_BTHD, k_BKSD), ok_BKTS)
    K = k_BKSD.shape[1]
    p_BKMS = p.reshape(B, K, H // K * T, -1).astype(v_BKSD.dtype)  # same layout as logits
    o = jnp.einsum("bkms,bksd->bkmd", p_BKMS, v_BKSD, preferred_element_type=jnp.float32)
    o = o.reshape(B, K, H // K, T, D).transpose(0, 3, 1, 2, 4)
    o = o.reshape(B, T, H, D).astype(q_BTHD.dtype)
    return (o, p) if return_probs else o


def attend_chunked(q_BTHD, k_BKSD, v_BKSD, qpos_BT, kpos_BKS, kvalid_BKS, sliding_window,
                   block: int = 512):
    """`attend` over query blocks so that prefill never holds [H, T, S] scores at once."""
    B, T, H, D = q_BTHD.shape
    if T <= block or T % block:
        return attend(q_BTHD, k_BKSD, v_BKSD,
                      mask(qpos_BT, kpos_BKS, kvalid_BKS, sliding_window))
    nb = T // block
    qb = q_BTHD.reshape(B, nb, block, H, D).swapaxes(0, 1)
    pb = qpos_BT.reshape(B, nb, block).swapaxes(0, 1)

    def one(args):
        q, p = args
        return attend(q, k_BKSD, v_BKSD, mask(p, kpos_BKS, kvalid_BKS, sliding_window))

    o = jax.lax.map(one, (qb, pb))
    return o.swapaxes(0, 1).reshape(B, T, H, D)


def attend_blocked(q_BTHD, k_BKSD, v_BKSD, qpos_BT, kpos_BKS, kvalid_BKS, sliding_window,
                   ordered: bool = False, with_lse: bool = False):
    """`attend` in tiles with an online softmax (flash attention's recurrence, in plain
    XLA): per batch element and query block, a loop over key blocks keeps the running max,
    sum and output, so no score array larger than one tile ([K, G, bq, bk], a few MB)
    exists. On CPU the dense form is bound by writing and re-reading the [H, T, S]
    scores (2.2x slower at 2048 on SmolLM2's shape, docs/results/speed.md); tiles stay in
    cache. Equal to `attend` up to float32 rounding (1e-6 measured).

    `ordered`: the keys are the queries' own tokens in slot order (slot i holds query i's
    key, positions increase with the slot: a left-padded prompt), so a query block stops
    at the key block holding its last slot (causal: about half the tiles). Key blocks of
    256 (128, 64 where T and S are not multiples), query blocks of twice that where T is
    a multiple of it; shorter prompts take `attend`.

    `with_lse`: also each query's log-sum-exp over the keys it sees, [B, K, G, T] float32
    (+inf where it sees none; None on the short-prompt path): the online softmax has it
    for free, and H2O's column sums (`scoring.cumulative_attention`) need it."""
    B, T, H, D = q_BTHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G = H // K
    bk = next((b for b in (256, 128, 64) if T % b == 0 and S % b == 0), None)
    if bk is None or T < 2 * bk:
        o = attend(q_BTHD, k_BKSD, v_BKSD, mask(qpos_BT, kpos_BKS, kvalid_BKS, sliding_window))
        return (o, None) if with_lse else o
    # query blocks twice the key blocks where T allows: the tile's two matmuls are larger
    # ([G*512, D] x [D, 256]); 13% faster at 2048 and 4096 than square 256 tiles on 2 CPU
    # cores (docs/results/speed.md), though the diagonal now costs two tiles, not one
    bq = 2 * bk if T % (2 * bk) == 0 and T >= 4 * bk else bk
    nq, nk = T // bq, S // bk
    q_BKGTD = q_BTHD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
    cut = lambda a, i, axis, n=bk: jax.lax.dynamic_slice_in_dim(a, i * n, n, axis)  # noqa: E731

    def element(args):
        q, k, v, qpos, kpos, kvalid = args  # one batch element

        def query_block(i):
            qi, qp = cut(q, i, 2, bq).reshape(K, G * bq, D), cut(qpos, i, 0, bq)

            def key_block(j, carry):
                m, z, acc = carry
                s = jnp.einsum("kmd,ksd->kms", qi, cut(k, j, 1),
                               preferred_element_type=jnp.float32)
                # scaled in float32 as `logits` does (a bf16 q scaled first would round)
                s = s.reshape(K, G, bq, bk) * (D**-0.5)
                ok = mask(qp[None], cut(kpos, j, 1)[None], cut(kvalid, j, 1)[None],
                          sliding_window)[0][:, None]
                s = jnp.where(ok, s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no live key yet: 0
                p = jnp.exp(s - base[..., None])
                scale = jnp.exp(m - base)  # m = -inf: 0
                pv = jnp.einsum("kms,ksd->kmd", p.reshape(K, G * bq, bk).astype(v.dtype),
                                cut(v, j, 1), preferred_element_type=jnp.float32)
                return (m_new, z * scale + jnp.sum(p, axis=-1),
                        acc * scale[..., None] + pv.reshape(K, G, bq, D))

            n = jnp.minimum(((i + 1) * bq - 1) // bk + 1, nk) if ordered else nk
            init = (jnp.full((K, G, bq), -jnp.inf, jnp.float32),
                    jnp.zeros((K, G, bq), jnp.float32), jnp.zeros((K, G, bq, D), jnp.float32))
            m, z, acc = jax.lax.fori_loop(0, n, key_block, init)
            lse = jnp.where(z > 0, m + jnp.log(jnp.where(z > 0, z, 1.0)), jnp.inf)
            return acc / jnp.where(z > 0, z, 1.0)[..., None], lse  # no live key: zeros

        o, lse = jax.lax.map(query_block, jnp.arange(nq))  # [nq, K, G, bq, (D)]
        return (o.transpose(0, 3, 1, 2, 4).reshape(T, H, D),
                lse.transpose(1, 2, 0, 3).reshape(K, G, T))

    o, lse = jax.lax.map(element, (q_BKGTD, k_BKSD, v_BKSD, qpos_BT, kpos_BKS, kvalid_BKS))
    o = o.astype(q_BTHD.dtype)
    return (o, lse) if with_lse else o


def attend_fused(q_BTHD, k_BKTD, v_BKTD, valid_BT, sliding_window, implementation: str,
                 with_lse: bool = False):
    """The prompt's causal attention as one fused call (`jax.nn.dot_product_attention`:
    cuDNN's flash attention on NVIDIA GPUs), equal to `attend_chunked` when each row's
    tokens are one contiguous run of slots whose positions increase by one (a left- or
    right-padded prompt, `engine.inputs.positions`).

    The fused kernels mask by index (causal) and by sequence length (right padding), so
    each row is rolled left to its first token, attended with its length, and rolled back;
    padding queries come back as zeros. `with_lse`: (o, each query's log-sum-exp
    [B, K, G, T] float32, +inf on padding queries): the call's own softmax statistic
    (`return_residual`), as `attend_blocked` gives it."""
    B, T, H, D = q_BTHD.shape
    K = k_BKTD.shape[1]
    n_B = jnp.sum(valid_BT, axis=1, dtype=jnp.int32)
    first = jnp.argmax(valid_BT, axis=1)
    idx = (jnp.arange(T)[None, :] + first[:, None]) % T  # row b: its tokens first
    left = lambda x: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)  # noqa: E731
    window = None if sliding_window is None else (sliding_window - 1, 0)
    o = jax.nn.dot_product_attention(
        left(q_BTHD), left(k_BKTD.swapaxes(1, 2)), left(v_BKTD.swapaxes(1, 2)),
        is_causal=True, query_seq_lengths=n_B, key_value_seq_lengths=n_B,
        local_window_size=window, implementation=implementation, return_residual=with_lse)
    o, lse_BTH = o if with_lse else (o, None)
    back = (jnp.arange(T)[None, :] - first[:, None]) % T  # the roll undone (idx's inverse)
    o = jnp.take_along_axis(o, back[:, :, None, None], axis=1)
    o = jnp.where(valid_BT[:, :, None, None], o, 0).astype(q_BTHD.dtype)
    if not with_lse:
        return o
    lse_BTH = jnp.take_along_axis(lse_BTH.astype(jnp.float32), back[:, :, None], axis=1)
    lse_BTH = jnp.where(valid_BT[:, :, None], lse_BTH, jnp.inf)
    return o, lse_BTH.reshape(B, T, K, H // K).transpose(0, 2, 3, 1)


def attend_prompt(q_BTHD, k_BKTD, v_BKTD, qpos_BT, kpos_BKT, kvalid_BKT, sliding_window,
                  implementation: str = "xla", ordered: bool = False, with_lse: bool = False):
    """The prompt's attention: `attend_chunked` ("xla"), `attend_blocked` ("blocked", the
    CPU default; `ordered` as there), or one fused call ("cudnn", or "fused_xla" for the
    same call's xla implementation; see `attend_fused`: the prompt's tokens must be
    contiguous slots). A window that is per-layer data (a traced value,
    `transformer.layer_window`) takes the `attend_chunked` path: the fused calls need it
    static. `with_lse`: (o, each query's log-sum-exp [B, K, G, T] or None), the latter from
    the blocked attention and the fused call (not the chunked one)."""
    if implementation == "blocked":
        return attend_blocked(q_BTHD, k_BKTD, v_BKTD, qpos_BT, kpos_BKT, kvalid_BKT,
                              sliding_window, ordered, with_lse)
    if implementation == "xla" or isinstance(sliding_window, jax.Array):
        o = attend_chunked(q_BTHD, k_BKTD, v_BKTD, qpos_BT, kpos_BKT, kvalid_BKT,
                           sliding_window)
        return (o, None) if with_lse else o
    return attend_fused(q_BTHD, k_BKTD, v_BKTD, kvalid_BKT[:, 0], sliding_window,
                        "xla" if implementation == "fused_xla" else implementation, with_lse)
