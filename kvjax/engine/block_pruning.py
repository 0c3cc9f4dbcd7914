"""Prefill in stages of layers on shrinking block sets (SlimInfer, LazyLLM:
`prefill_kind = "block_pruning"`), with fixed shapes.

The left-padded prompt is first laid out as blocks (slot s holds position s; slots past the
prompt are dead). Stage 0 (layers 0..p_1) runs on every block. At pruning layer p_i the
method scores the blocks from that layer's queries and keys (`group_scores`) and
chooses the ones to keep (`choose_groups`: its forced blocks plus the top ones); their
hidden states are gathered with their original positions -- right after the pruning
layer's attention (`plan.prune_after = "attention"`, the paper: its MLP runs on the kept
tokens only) or after its MLP ("mlp") -- and stage i (layers p_i+1..p_{i+1}) runs on them
only. (The MLP acts on each token alone, so both give the same kept hidden states; the
first saves the pruned tokens' MLP.) Each stage is one `lax.scan` over its layers with the
stage's static token count (`plan`), so a (padded length, schedule) pair compiles once;
per element the kept sets differ. Each layer's KV holds the tokens that layer saw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.compression.cache import LayerKV
from kvjax.compression.protocols import BlockPruning
from kvjax.config import ModelConfig
from kvjax.models import attention, transformer
from kvjax.pallas.dispatch import Kernels


def stage_params(params, a: int, b: int):
    """The stacked parameters of layers [a, b)."""
    return jax.tree.map(lambda w: w[a:b], params["layers"])


def run_stage(params, cfg: ModelConfig, a: int, b: int, x, pos_BS, valid_BS, tail_Bw,
              mlp_first: bool = False, attention_last: bool = False, attn: str = "xla"):
    """Layers [a, b) on the token set x [B, S, D]: the new x, per-layer (k, v) and the
    queries of the last w prompt tokens at each layer [n, B, w, H, Dh].

    `mlp_first`: layer a-1's MLP runs first, on these tokens (its attention ran on the
    previous, larger set: pruning right after the pruning layer's attention);
    `attention_last`: layer b-1 stops after its attention (its MLP is the next stage's);
    `attn`: the prompt attention's implementation (`attention.attend_prompt`)."""
    B, S = pos_BS.shape
    K = cfg.num_kv_heads
    kpos = jnp.broadcast_to(pos_BS[:, None], (B, K, S))
    kvalid = jnp.broadcast_to(valid_BS[:, None], (B, K, S))

    def attend(p, x, layer):
        q, k, v = transformer.qkv(p, cfg, x, pos_BS)
        # ordered (attention.attend_blocked): kept blocks stay in order, positions rise
        o = attention.attend_prompt(q, k, v, pos_BS, kpos, kvalid,
                                    transformer.layer_window(cfg, layer), attn, ordered=True)
        qt = jnp.take_along_axis(q, tail_Bw[:, :, None, None], axis=1)
        return transformer.attention_residual(p, cfg, x, o), (k, v, qt)

    def body(x, xs):
        p, layer = xs
        x, out = attend(p, x, layer)
        return transformer.mlp_residual(p, cfg, x), out

    if mlp_first:
        x = transformer.mlp_residual(transformer.layer_slice(params, a - 1), cfg, x)
    end = b - 1 if attention_last else b
    x, outs = jax.lax.scan(body, x, (stage_params(params, a, end), jnp.arange(a, end)))
    if attention_last:
        x, last = attend(transformer.layer_slice(params, b - 1), x, b - 1)
        outs = jax.tree.map(lambda o, l: jnp.concatenate([o, l[None]]), outs, last)
    return x, outs


def block_layout(tokens_BT, valid_BT, T_slots: int):
    """Left padding -> block layout: slot s holds prompt position s (dead past the prompt)."""
    B, T = tokens_BT.shape
    n = jnp.sum(valid_BT, axis=1, dtype=jnp.int32)
    s = jnp.arange(T_slots, dtype=jnp.int32)
    col = jnp.clip(s[None] + (T - n)[:, None], 0, T - 1)
    return (jnp.take_along_axis(tokens_BT, col, axis=1), jnp.broadcast_to(s, (B, T_slots)),
            s[None] < n[:, None], n)


def take_groups(x_BS, idx_BG, block: int):
    """Gather whole groups of `block` slots along axis 1 (any trailing dims)."""
    B, S = x_BS.shape[:2]
    g = x_BS.reshape(B, S // block, block, *x_BS.shape[2:])
    ix = idx_BG.reshape(B, -1, *([1] * (g.ndim - 2)))
    out = jnp.take_along_axis(g, ix, axis=1)
    return out.reshape(B, -1, *x_BS.shape[2:])


def tail_slots(pos_BS, valid_BS, w: int):
    """Slots of the last w prompt tokens (the largest live positions), ascending."""
    _, idx = jax.lax.top_k(jnp.where(valid_BS, pos_BS, -1), w)
    return jnp.sort(idx, axis=1)


def prefill(m: BlockPruning, params, cfg: ModelConfig, tokens_BT, valid_BT, pos_BT, kernels: Kernels):
    """-> (last hidden [B, D], per-layer kv with T' = NB * block slots, decode state or
    None, stats)."""
    B, T = tokens_BT.shape
    plan = m.plan(cfg, T)
    bs, NB, w = plan.block, plan.num_blocks, plan.window
    tok, pos, valid, n = block_layout(tokens_BT, valid_BT, plan.slots)
    x = params["embed"][tok]
    blk = jnp.broadcast_to(jnp.arange(NB, dtype=jnp.int32), (B, NB))
    glive = blk * bs < n[:, None]
    kv, pruned = [], []
    for i, (a, b) in enumerate(plan.stages):
        if i > 0:  # prune after layer p_i = a - 1
            s, units = m.group_scores(qt, kv[-1].k[-1], valid)
            idx, live = m.choose_groups(i - 1, plan, s, blk, glive, n)
            pruned.append(dict(scores=jnp.full((B, NB), -jnp.inf).at[
                jnp.arange(B)[:, None], blk].set(jnp.where(glive, s, -jnp.inf)),
                qring=qt, units=units, ublk=blk, aux=x))
            x, pos = take_groups(x, idx, bs), take_groups(pos, idx, bs)
            valid = take_groups(valid, idx, bs) & jnp.repeat(live, bs, axis=1)
            blk, glive = jnp.take_along_axis(blk, idx, axis=1), live
            pruned[-1].update(blocks=blk, blive=live)
        tail = tail_slots(pos, valid, w)
        split = plan.prune_after == "attention"
        # a fused attention masks by slot index: kept blocks keep their order, but a sliding
        # window would count the gaps between them
        attn = (kernels.prompt_attention(x.dtype) if i == 0 or cfg.sliding_window is None
                else "xla")
        x, (k, v, qts) = run_stage(params, cfg, a, b, x, pos, valid, tail,
                                   mlp_first=split and i > 0,
                                   attention_last=split and i < len(plan.stages) - 1, attn=attn)
        qt = qts[-1]
        kv.append(LayerKV(k, v, pos, valid))
    last = jnp.take_along_axis(x, tail[:, -1:, None], axis=1)[:, 0]
    stats = _stats(plan, pruned, kv, B)
    state = m.block_state(plan, T, n, pruned)
    return last, _stack(kv, plan.slots, cfg.num_kv_heads), state, stats


def _stack(kv: list[LayerKV], T_slots: int, K: int) -> LayerKV:
    """Per-stage kv (pos, valid per token) -> one [L, B, K, T', ...] stack, dead slots padded."""
    out = [[], [], [], []]
    for s in kv:
        nl, B, _, S, _ = s.k.shape
        pad = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, T_slots - S)] + [(0, 0)] * (a.ndim - 4))
        out[0].append(pad(s.k))
        out[1].append(pad(s.v))
        out[2].append(pad(jnp.broadcast_to(s.pos[None, :, None], (nl, B, K, S))))
        out[3].append(pad(jnp.broadcast_to(s.valid[None, :, None], (nl, B, K, S))))
    return LayerKV(*(jnp.concatenate(a, axis=0) for a in out))


def _stats(plan, pruned: list[dict], kv: list[LayerKV], B: int) -> dict:
    """Per element: the blocks each stage kept (-1 padded), the live tokens per stage and
    per layer, and the block scores at each pruning layer (by block id, -inf = absent)."""
    width = max(plan.blocks, default=1)
    per_stage = [jnp.sum(s.valid, axis=1, dtype=jnp.int32) for s in kv]  # [B] each
    per_layer = [jnp.broadcast_to(t[:, None], (B, s.k.shape[0])) for t, s in zip(per_stage, kv)]
    layer_tokens = jnp.concatenate(per_layer, axis=1)
    mlp_tokens = layer_tokens
    if plan.prune_after == "attention":  # each pruning layer's MLP runs on the next stage
        for p, t in zip(plan.layers, per_stage[1:]):
            mlp_tokens = mlp_tokens.at[:, p].set(t)
    slots = [s.k.shape[3] for s in kv]  # the static token slots each stage runs
    stats = {"layer_tokens": layer_tokens,
             "mlp_tokens": mlp_tokens,
             "stage_slots": jnp.broadcast_to(jnp.asarray(slots, jnp.int32), (B, len(slots))),
             "stage_tokens": jnp.stack(per_stage, axis=1),
             "pruning_layers": jnp.broadcast_to(jnp.asarray(plan.layers or (-1,), jnp.int32),
                                                (B, max(len(plan.layers), 1)))}
    if pruned:
        stats["kept_blocks"] = jnp.stack([
            jnp.pad(jnp.where(p["blive"], p["blocks"], -1),
                    [(0, 0), (0, width - p["blocks"].shape[1])], constant_values=-1)
            for p in pruned], axis=1)
        stats["block_scores"] = jnp.stack([p["scores"] for p in pruned], axis=1)
    return stats
