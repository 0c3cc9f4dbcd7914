"""Token scores shared by the eviction methods (docs/methods.md, "Conventions").

Every function is pure `jnp`, padding-aware and shape-annotated. Conventions:

- prompts are left-padded: `valid_BT` is False on padding, the last `window` columns are
  the last `window` prompt tokens of every batch element;
- attention probabilities are a softmax in float32 at scale 1/sqrt(d) over every key a
  query may see (live, not in its future), exactly as the model's own attention;
- scores of padding columns come out as 0 (they get no attention), which is what
  PyTorch's zero padding gives avg pooling at the left edge; selection helpers turn them
  into -inf so they are never kept (`mask_padding`);
- nothing larger than [B, H, window, n] (window scores) or [B, H, block, n] (cumulative
  attention) is materialised.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.models import attention

# window scores (and the choices they take) are the window_scores op's reference math
from kvjax.pallas.ops.window_scores.xla import (  # noqa: E402,F401
    GQA_REDUCTIONS, POOLINGS, WINDOW_REDUCTIONS, gqa_reduce, mask_padding, pool1d,
    snap_scores, window_attention)


def plogp(p):
    """p log p elementwise, 0 where p = 0 (its limit; the log of 0 is never taken, so its
    gradient is finite too): -sum(plogp(p)) is an entropy."""
    return jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)


def last_token_attention(
    q_BTHD: Float[Array, "B T H D"],
    k_BKSD: Float[Array, "B K S D"],
    valid_BS: Bool[Array, "B S"],
) -> Float[Array, "B K G S"]:
    """Softmax attention of the last query over every live column (TOVA; LazyLLM over the
    tokens a stage kept). The last query sees every column: it is the newest token."""
    B = q_BTHD.shape[0]
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    s = attention.logits(q_BTHD[:, -1:], k_BKSD)  # [B, K, G, 1, S]
    ok = jnp.broadcast_to(valid_BS[:, None, None, :], (B, K, 1, S))
    return attention.softmax(s, ok)[..., 0, :]


def fold_query_blocks(
    step: Callable,
    init: Any,
    q_BTHD: Float[Array, "B T H D"],
    k_BKSD: Float[Array, "B K S D"],
    qpos_BT: Int[Array, "B T"],
    qvalid_BT: Bool[Array, "B T"],
    kpos_BKS: Int[Array, "B K S"],
    kvalid_BKS: Bool[Array, "B K S"],
    block: int = 256,
    lse_BKGT: Float[Array, "B K G T"] | None = None,
) -> Any:
    """`carry = step(carry, probs [B, K, G, b, S], ok [B, K, b, S], qvalid [B, b])` over
    blocks of `block` queries of the causal softmax (a `lax.scan`), so that at most
    [B, H, block, S] exists at a time; the last block is padded with invalid queries.

    `lse_BKGT`: each query's log-sum-exp over these keys, where the prompt attention
    computed it (the fused call's, `attention.attend_fused`): it shifts the scores in place
    of the softmax's max pass. Each row is still divided by its own sum (a band holds whole
    rows): jax returns cuDNN's log-sum-exp in the output dtype, and a bf16 one is off by up
    to ~0.03, a 3% scale the division removes. On a GPU the prompt attention then stays
    cuDNN's (issue 52, item 2: the chunked attention made H2O's prefill 7x full's at 32k)."""
    B, T, H, D = q_BTHD.shape
    K = k_BKSD.shape[1]
    block = min(block, T)
    nb = -(-T // block)
    pad = nb * block - T
    given = lse_BKGT is not None
    if pad:
        q_BTHD = jnp.pad(q_BTHD, [(0, 0), (0, pad), (0, 0), (0, 0)])
        qpos_BT = jnp.pad(qpos_BT, [(0, 0), (0, pad)])
        qvalid_BT = jnp.pad(qvalid_BT, [(0, 0), (0, pad)])
        if given:
            lse_BKGT = jnp.pad(lse_BKGT, [(0, 0), (0, 0), (0, 0), (0, pad)])
    qb = q_BTHD.reshape(B, nb, block, H, D).swapaxes(0, 1)
    pb = qpos_BT.reshape(B, nb, block).swapaxes(0, 1)
    vb = qvalid_BT.reshape(B, nb, block).swapaxes(0, 1)
    # None (no log-sum-exp) is an empty pytree: the scan carries nothing for it
    lb = lse_BKGT.reshape(B, K, H // K, nb, block).transpose(3, 0, 1, 2, 4) if given else None

    def one(carry, xs):
        q, p, v, lse = xs
        ok = attention.mask(p, kpos_BKS, kvalid_BKS)
        s = attention.logits(q, k_BKSD)
        if given:
            # +inf (a query that sees no key) gives exp(-inf) = 0, as the softmax's zeros
            e = jnp.where(ok[:, :, None], jnp.exp(s - lse[..., None]), 0.0)
            z = jnp.sum(e, axis=-1, keepdims=True)
            probs = e / jnp.where(z > 0, z, 1.0)
        else:
            probs = attention.softmax(s, ok)
        return step(carry, probs, ok, v), None

    return jax.lax.scan(one, init, (qb, pb, vb, lb))[0]


def cumulative_attention(
    q_BTHD: Float[Array, "B T H D"],
    k_BKSD: Float[Array, "B K S D"],
    qpos_BT: Int[Array, "B T"],
    qvalid_BT: Bool[Array, "B T"],
    kpos_BKS: Int[Array, "B K S"],
    kvalid_BKS: Bool[Array, "B K S"],
    block: int = 256,
    tiled: bool = False,
    lse_BKGT: Float[Array, "B K G T"] | None = None,
) -> Float[Array, "B K G S"]:
    """H2O's accumulated attention: column sums of the causal softmax over every valid query.
    Padding queries contribute nothing.

    Blockwise over queries (`fold_query_blocks`, [B, H, block, S] at a time), or with
    `tiled` (the methods pass it where the prompt attention is the CPU's tiled one) in
    [block, block] tiles when T and S are multiples of `block` (`_tiled_column_sums`).
    `lse_BKGT`: each query's log-sum-exp over these keys, where the prompt attention
    computed it (`LayerIO.lse`): the tiled form then skips its first pass, the query-band
    form its max pass (`fold_query_blocks`)."""
    B, T, H, D = q_BTHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    if tiled and T % block == 0 and S % block == 0:
        return _tiled_column_sums(q_BTHD, k_BKSD, qpos_BT, qvalid_BT, kpos_BKS, kvalid_BKS,
                                  block, lse_BKGT)

    def step(acc, probs, ok, v):
        return acc + jnp.sum(jnp.where(v[:, None, None, :, None], probs, 0.0), axis=3)

    return fold_query_blocks(step, jnp.zeros((B, K, H // K, S), jnp.float32), q_BTHD, k_BKSD,
                             qpos_BT, qvalid_BT, kpos_BKS, kvalid_BKS, block, lse_BKGT)


def _tiled_column_sums(q_BTHD, k_BKSD, qpos_BT, qvalid_BT, kpos_BKS, kvalid_BKS, block,
                       lse_BKGT=None):
    """`cumulative_attention` in tiles, per batch element and query block: one pass over
    the key blocks for each row's log-sum-exp (max and sum online, as flash attention;
    skipped when `lse_BKGT` gives it), a second adding exp(s - lse) into the column sums.
    A key block no query of the block can see (all in the future: half the tiles of a
    causal prompt) is skipped. The query-
    band form computes and normalises every [block, S] row band, masked half included, out
    of cache: in a sweep at 2048 on 2 CPU cores H2O's hook took 23 s a batch of 8 that way,
    16 s tiled (docs/results/speed.md)."""
    B, T, H, D = q_BTHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G, nq, nk = H // K, T // block, S // block
    q_BKGTD = q_BTHD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
    # a tile is skipped when its earliest live key is after its latest live query
    big = jnp.iinfo(jnp.int32).max
    kmin_BN = jnp.min(jnp.where(kvalid_BKS, kpos_BKS, big).reshape(B, K, nk, block), (1, 3))
    qmax_BN = jnp.max(jnp.where(qvalid_BT, qpos_BT, -1).reshape(B, nq, block), axis=2)
    cut = lambda a, i, axis: jax.lax.dynamic_slice_in_dim(a, i * block, block, axis)  # noqa: E731
    given = lse_BKGT is not None
    if not given:  # an empty stand-in for `lax.map`: the first pass computes it per block
        lse_BKGT = jnp.zeros((B, 0), jnp.float32)

    def element(args):
        q, k, kpos, kvalid, qpos, qvalid, kmin, qmax, lse_KGT = args

        def query_block(i, acc_KGS):
            q_i = cut(q, i, 2).reshape(K, G * block, D)

            def tile(j):  # masked scaled logits [K, G, block, block]
                s = jnp.einsum("kmd,ksd->kms", q_i, cut(k, j, 1),
                               preferred_element_type=jnp.float32)
                ok = attention.mask(cut(qpos, i, 0)[None], cut(kpos, j, 1)[None],
                                    cut(kvalid, j, 1)[None])[0][:, None]
                return jnp.where(ok, s.reshape(K, G, block, block) * (D**-0.5), -jnp.inf)

            def seen(j, f, carry):
                return jax.lax.cond(kmin[j] <= qmax[i], f, lambda c: c, carry)

            def stats(j, c):
                def one(c):
                    m, z = c
                    s = tile(j)
                    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                    base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no live key yet
                    return m_new, (z * jnp.exp(m - base)
                                   + jnp.sum(jnp.exp(s - base[..., None]), axis=-1))
                return seen(j, one, c)

            if given:  # the prompt attention's; a padding query adds nothing
                lse = jnp.where(cut(qvalid, i, 0)[None, None], cut(lse_KGT, i, 2), jnp.inf)
            else:
                init = (jnp.full((K, G, block), -jnp.inf, jnp.float32),
                        jnp.zeros((K, G, block), jnp.float32))
                m, z = jax.lax.fori_loop(0, nk, stats, init)
                # a padding query, or one with no live key, adds exp(-inf) = 0 everywhere
                live = cut(qvalid, i, 0)[None, None] & (z > 0)
                lse = jnp.where(live, jnp.where(jnp.isfinite(m), m, 0.0)
                                + jnp.log(jnp.where(z > 0, z, 1.0)), jnp.inf)

            def columns(j, acc):
                def one(acc):
                    p = jnp.exp(tile(j) - lse[..., None])
                    return jax.lax.dynamic_update_slice_in_dim(
                        acc, cut(acc, j, 2) + jnp.sum(p, axis=2), j * block, 2)
                return seen(j, one, acc)

            return jax.lax.fori_loop(0, nk, columns, acc_KGS)

        return jax.lax.fori_loop(0, nq, query_block, jnp.zeros((K, G, S), jnp.float32))

    return jax.lax.map(element, (q_BKGTD, k_BKSD, kpos_BKS, kvalid_BKS, qpos_BT, qvalid_BT,
                                 kmin_BN, qmax_BN, lse_BKGT))


def observed_attention(
    q_BTHD: Float[Array, "B T H D"],
    k_BKTD: Float[Array, "B K T D"],
    pos_BT: Int[Array, "B T"],
    valid_BT: Bool[Array, "B T"],
    block: int = 256,
    tiled: bool = False,
    lse_BKGT: Float[Array, "B K G T"] | None = None,
) -> Float[Array, "B K G T"]:
    """kvpress `ObservedAttentionPress`: column sums divided by the number of queries that
    see the column (n - i for the token at position i of an n-token prompt); `tiled` and
    `lse_BKGT` as in `cumulative_attention`."""
    B, T = valid_BT.shape
    K = k_BKTD.shape[1]
    kpos = jnp.broadcast_to(pos_BT[:, None], (B, K, T))
    kvalid = jnp.broadcast_to(valid_BT[:, None], (B, K, T))
    acc = cumulative_attention(q_BTHD, k_BKTD, pos_BT, valid_BT, kpos, kvalid, block, tiled,
                               lse_BKGT)
    n = jnp.sum(valid_BT, axis=1, dtype=jnp.int32)
    count = jnp.maximum(n[:, None] - pos_BT, 1).astype(jnp.float32)  # [B, T]
    return acc / count[:, None, None, :]


def v_norms(v_BKTD: Float[Array, "B K T D"], ord: int = 1) -> Float[Array, "B K T"]:
    """||v||_ord of every value row (VATP/LAVa weight scores with it), in float32."""
    v = v_BKTD.astype(jnp.float32)
    if ord == 1:
        return jnp.sum(jnp.abs(v), axis=-1)
    if ord == 2:
        return jnp.sqrt(jnp.sum(v * v, axis=-1))
    raise ValueError(f"value norm ord={ord}; allowed: 1, 2")


def max_value_norm(v_BKTD: Float[Array, "B K T D"], valid_BT: Bool[Array, "B T"],
                   ord: int = 1) -> Float[Array, "B K"]:
    """LAVa's per-head factor max_k ||V[k]||_ord over the live rows."""
    return jnp.max(jnp.where(valid_BT[:, None, :], v_norms(v_BKTD, ord), 0.0), axis=-1)
