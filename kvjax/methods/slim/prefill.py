"""SlimInfer / LazyLLM prefill: stages of layers on shrinking block sets, fixed shapes.

The left-padded prompt is first laid out as blocks (slot s holds position s; slots past the
prompt are dead). Stage 0 (layers 0..p_1) runs on every block. After pruning layer p_i's
MLP the blocks are scored from that layer's queries and keys (Eq. 2, or LazyLLM's
last-token attention), the forced blocks plus the top ones are kept, their hidden states
are gathered with their original positions, and stage i (layers p_i+1..p_{i+1}) runs on
them only. Each stage is one `lax.scan` over its layers with the stage's static token
count, so a (padded length, schedule) pair compiles once; per element the kept sets differ.
Each layer's KV holds the tokens that layer saw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array

from kvjax.config import ModelConfig
from kvjax.methods.slim import core
from kvjax.models import attention, transformer


def stage_params(params, a: int, b: int):
    """The stacked parameters of layers [a, b)."""
    return jax.tree.map(lambda w: w[a:b], params["layers"])


def run_stage(params, cfg: ModelConfig, a: int, b: int, x, pos_BS, valid_BS, tail_Bw):
    """Layers [a, b) on the token set x [B, S, D]: the new x, per-layer (k, v) and the
    queries of the last w prompt tokens at each layer [n, B, w, H, Dh]."""
    B, S = pos_BS.shape
    K = cfg.num_kv_heads
    kpos = jnp.broadcast_to(pos_BS[:, None], (B, K, S))
    kvalid = jnp.broadcast_to(valid_BS[:, None], (B, K, S))

    def body(x, p):
        q, k, v = transformer.qkv(p, cfg, x, pos_BS)
        o = attention.attend_chunked(q, k, v, pos_BS, kpos, kvalid, cfg.sliding_window)
        x = transformer.finish_layer(p, cfg, x, o)
        qt = jnp.take_along_axis(q, tail_Bw[:, :, None, None], axis=1)
        return x, (k, v, qt)

    return jax.lax.scan(body, x, stage_params(params, a, b))


def block_layout(tokens_BT, valid_BT, T_slots: int):
    """Left padding -> block layout: slot s holds prompt position s (dead past the prompt)."""
    B, T = tokens_BT.shape
    n = jnp.sum(valid_BT, axis=1, dtype=jnp.int32)
    s = jnp.arange(T_slots, dtype=jnp.int32)
    col = jnp.clip(s[None] + (T - n)[:, None], 0, T - 1)
    return (jnp.take_along_axis(tokens_BT, col, axis=1), jnp.broadcast_to(s, (B, T_slots)),
            s[None] < n[:, None], n)


def scores(m, q_tail, k_BKSD, valid_BS) -> Array:
    """Group scores at a pruning layer: Eq. 2 over units, or LazyLLM's last-token attention
    (block = unit = 1, so a group is a token). Also the unit keys (decode needs them)."""
    if m.score == "attention":
        return core.last_token_attention(q_tail[:, -1], k_BKSD, valid_BS), None
    rep, ok = core.unit_keys(k_BKSD, valid_BS, m.block, m.unit)
    return core.block_scores(core.query_mean(q_tail), rep, ok), (rep, ok)


def prefill(m, params, cfg: ModelConfig, tokens_BT, valid_BT, pos_BT):
    """Method.prefill for SlimInfer-like methods: (last hidden [B, D], per-layer kv with
    T' = NB * block slots, decode state or None, stats)."""
    B, T = tokens_BT.shape
    plan = m.plan(cfg, T)
    bs, NB, w = plan.block, plan.num_blocks, m.window
    tok, pos, valid, n = block_layout(tokens_BT, valid_BT, plan.slots)
    x = params["embed"][tok]
    blk = jnp.broadcast_to(jnp.arange(NB, dtype=jnp.int32), (B, NB))
    glive = blk * bs < n[:, None]
    kept, kv, qrings, units, ublk, aux = [], [], [], [], [], []
    sc_all = []
    for i, (a, b) in enumerate(plan.stages):
        if i > 0:  # prune after layer p_i = a - 1
            s, rep = scores(m, qt, kv[-1][0][-1], valid)
            forced = core.forced_mask(blk, n, bs, w, m.sink_blocks)
            count = jnp.full((B,), plan.blocks[i - 1], jnp.int32)
            if plan.ratio is not None:
                present = jnp.sum(glive, axis=1, dtype=jnp.int32)
                count = jnp.ceil(plan.ratio * present).astype(jnp.int32)
            idx, live = core.choose(s, forced, glive, count, plan.blocks[i - 1])
            sc_all.append(jnp.full((B, NB), -jnp.inf).at[jnp.arange(B)[:, None], blk].set(
                jnp.where(glive, s, -jnp.inf)))
            qrings.append(qt)
            units.append(rep)
            ublk.append(blk)
            aux.append(x)
            x, pos = core.take_groups(x, idx, bs), core.take_groups(pos, idx, bs)
            valid = core.take_groups(valid, idx, bs) & jnp.repeat(live, bs, axis=1)
            blk, glive = jnp.take_along_axis(blk, idx, axis=1), live
            kept.append((blk, live))
        tail = core.tail_slots(pos, valid, w)
        x, (k, v, qts) = run_stage(params, cfg, a, b, x, pos, valid, tail)
        qt = qts[-1]
        kv.append((k, v, pos, valid))
    last = jnp.take_along_axis(x, tail[:, -1:, None], axis=1)[:, 0]
    layer_kv = _stack(kv, plan.slots, cfg.num_kv_heads)
    stats = _stats(plan, kept, sc_all, kv, B)
    state = None
    if m.needs_decode_state:
        state = {"T": jnp.int32(T), "n": n, "players": jnp.asarray(plan.layers, jnp.int32),
                 "qring": jnp.stack(qrings) if qrings else None,
                 "blocks": tuple(b for b, _ in kept), "blive": tuple(lv for _, lv in kept),
                 "units": tuple(units), "ublk": tuple(ublk), "aux": tuple(aux)}
    return last, layer_kv, state, stats


def _stack(kv, T_slots: int, K: int):
    """Per-stage (k, v, pos, valid) -> one [L, B, K, T', ...] stack, dead slots padded."""
    out = [[], [], [], []]
    for k, v, pos, valid in kv:
        nl, B, _, S, _ = k.shape
        pad = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, T_slots - S)] + [(0, 0)] * (a.ndim - 4))
        out[0].append(pad(k))
        out[1].append(pad(v))
        out[2].append(pad(jnp.broadcast_to(pos[None, :, None], (nl, B, K, S))))
        out[3].append(pad(jnp.broadcast_to(valid[None, :, None], (nl, B, K, S))))
    return tuple(jnp.concatenate(a, axis=0) for a in out)


def _stats(plan, kept, sc_all, kv, B: int) -> dict:
    """Per element: the blocks each stage kept (-1 padded), the live tokens per stage and
    per layer, and the block scores at each pruning layer (by block id, -inf = absent)."""
    width = max(plan.blocks, default=1)
    blocks = [jnp.pad(jnp.where(lv, b, -1), [(0, 0), (0, width - b.shape[1])], constant_values=-1)
              for b, lv in kept]
    per_stage = [jnp.sum(v, axis=1, dtype=jnp.int32) for _, _, _, v in kv]  # [B] each
    per_layer = [jnp.broadcast_to(t[:, None], (B, k.shape[0]))
                 for t, (k, *_) in zip(per_stage, kv)]
    stats = {"layer_tokens": jnp.concatenate(per_layer, axis=1),
             "stage_tokens": jnp.stack(per_stage, axis=1),
             "pruning_layers": jnp.broadcast_to(jnp.asarray(plan.layers or (-1,), jnp.int32),
                                                (B, max(len(plan.layers), 1)))}
    if kept:
        stats["kept_blocks"] = jnp.stack(blocks, axis=1)
        stats["block_scores"] = jnp.stack(sc_all, axis=1)
    return stats


def layer_flops(cfg: ModelConfig, tokens: int, keys_mean: float) -> float:
    """FLOPs of one layer on `tokens` queries each seeing `keys_mean` keys on average:
    projections and SwiGLU MLP (2 per multiply-add) plus q.k and p.v."""
    D, H, K, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F = cfg.intermediate_size
    linear = 2 * tokens * (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F)
    return linear + 4 * tokens * keys_mean * H * Dh


def prefill_flop_ratio(cfg: ModelConfig, layer_tokens: list[int], n: int) -> float:
    """Computed prefill FLOPs with per-layer token counts vs the full prompt at every layer
    (causal attention: a token sees (t + 1) / 2 keys on average; scoring/gather excluded)."""
    pruned = sum(layer_flops(cfg, t, (t + 1) / 2) for t in layer_tokens)
    return pruned / (cfg.num_layers * layer_flops(cfg, n, (n + 1) / 2))

