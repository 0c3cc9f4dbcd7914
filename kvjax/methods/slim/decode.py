"""SlimInfer decoding: block re-selection at every step, KV of inactive blocks in host memory.

Device state (fixed shapes, one compiled step for the whole generation):
- stage 0 (preserve layers): every prompt block, always active, never moved;
- stage i >= 1: an active buffer of `blocks[i]` groups of `block` slots per layer; which
  block sits in which group is host bookkeeping (`gblk`), passed in with the slots'
  positions and validity;
- generated tokens: a separate buffer per layer, never pruned;
- per pruning layer p_i: the unit keys (Eq. 1) of every block that has KV at p_i, indexed
  by block id (a unit's mean key: 1/unit of one layer's keys, Quest-style metadata kept on
  device so that inactive blocks can be scored), and the last w queries at p_i (a ring).

One step (`step`): sample the token, run it through the stages, each layer attending to its
stage's active blocks and the generated tokens; blocks being *revived* (no KV at this
stage yet: pruned at prefill) first run the stage's layers from their stored hidden state
(LazyLLM's aux cache) attending to the active blocks, so their KV exists before the new
token attends. At the end, every stage's candidate set is scored (Eq. 2) with the mean of
the last w queries at its pruning layer.

Between steps (`run_decode`, on the host): Algorithm 1 per stage and element; blocks that
leave are offloaded unless host memory holds them, blocks that enter are fetched from host
memory (or revived from their hidden state), each one `device_put`.

Timing: the candidates computed in step t decide the active sets of step t+1 (the paper
decides inside step t, at layer p_i, and prefetches during that layer's FFN). A step is one
compiled call, so a swap must fall between calls; the one-step lag means the query window
that chooses the blocks of token t+1 ends at token t.

Cost: a step that revives blocks runs the stage's layers over its whole active buffer (the
revived groups are not compacted: fixed shapes), inside a `lax.cond` that only steps with a
revival take.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvcache
from kvjax import offload
from kvjax.config import ModelConfig
from kvjax.engine import compile_once
from kvjax.methods.slim import core
from kvjax.methods.slim.prefill import stage_params
from kvjax.models import attention, transformer


def attend_two(q, first, second):
    """Attention over two key sets at once (the stage's prompt blocks and the generated
    tokens): one softmax across both, without concatenating the K/V buffers."""
    (ka, va, oka), (kb, vb, okb) = first, second
    sa, sb = attention.logits(q, ka), attention.logits(q, kb)
    p = attention.softmax(jnp.concatenate([sa, sb], -1), jnp.concatenate([oka, okb], -1))
    Sa = ka.shape[2]
    B, T, H, D = q.shape
    o = jnp.einsum("bkgts,bksd->btkgd", p[..., :Sa].astype(va.dtype), va,
                   preferred_element_type=jnp.float32)
    o += jnp.einsum("bkgts,bksd->btkgd", p[..., Sa:].astype(vb.dtype), vb,
                    preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, D).astype(q.dtype)


def _bcast(a_BS, K):
    return jnp.broadcast_to(a_BS[:, None], (a_BS.shape[0], K, a_BS.shape[1]))


def decode_stage(params, cfg: ModelConfig, a: int, b: int, x, qpos, gen, prompt, revive):
    """Layers [a, b) for the new token (and, if `revive`, the revived groups first).

    gen = (gk, gv [L,B,K,G,Dh], gpos, gvalid [B,G], slot); prompt = (pk, pv [n,B,K,S,Dh],
    ppos, pvalid [B,S], rev [B,S], xr [B,S,D]). Returns x, gk, gv, pk, pv, xr and the new
    token's query at each layer [n, B, 1, H, Dh].
    """
    gk, gv, gpos, gvalid, slot = gen
    pk, pv, ppos, pvalid, rev, xr = prompt
    K, sw = cfg.num_kv_heads, cfg.sliding_window
    okp = attention.mask(qpos, _bcast(ppos, K), _bcast(pvalid, K), sw)
    okg = attention.mask(qpos, _bcast(gpos, K), _bcast(gvalid, K), sw)
    okr = attention.mask(ppos, _bcast(ppos, K), _bcast(pvalid, K), sw)

    def body(carry, xs):
        x, xr, gk, gv = carry
        p, j, pk_l, pv_l = xs
        if revive:  # the revived groups' KV at this layer, then their layer output
            qr, kr, vr = transformer.qkv(p, cfg, xr, ppos)
            r = rev[:, None, :, None]
            pk_l, pv_l = jnp.where(r, kr, pk_l), jnp.where(r, vr, pv_l)
            xr = transformer.finish_layer(p, cfg, xr, attention.attend(qr, pk_l, pv_l, okr))
        q, k, v = transformer.qkv(p, cfg, x, qpos)
        gk = gk.at[a + j, :, :, slot].set(k[:, :, 0].astype(gk.dtype))
        gv = gv.at[a + j, :, :, slot].set(v[:, :, 0].astype(gv.dtype))
        gk_l, gv_l = gk[a + j], gv[a + j]
        o = attend_two(q, (pk_l, pv_l, okp), (gk_l, gv_l, okg))
        x = transformer.finish_layer(p, cfg, x, o)
        return (x, xr, gk, gv), ((pk_l, pv_l, q) if revive else q)

    xs = (stage_params(params, a, b), jnp.arange(b - a), pk, pv)
    (x, xr, gk, gv), ys = jax.lax.scan(body, (x, xr, gk, gv), xs)
    if revive:
        pk, pv, qs = ys
    else:
        qs = ys
    return x, gk, gv, pk, pv, xr, qs


def push_ring(ring_BWHD, q_BHD, live_B):
    """The last w queries after appending this step's (elements that are done keep theirs)."""
    new = jnp.concatenate([ring_BWHD[:, 1:], q_BHD[:, None].astype(ring_BWHD.dtype)], axis=1)
    return jnp.where(live_B[:, None, None, None], new, ring_BWHD)


def candidates(bufs, meta, *, m, plan):
    """Per stage i >= 1: the candidate blocks [B, blocks[i]] (ascending ids), which are live,
    and the Eq. 2 scores of every block [B, NB] (-inf where not eligible)."""
    NB = plan.num_blocks
    ids = jnp.broadcast_to(jnp.arange(NB, dtype=jnp.int32), (meta["n"].shape[0], NB))
    real = ids * plan.block < meta["n"][:, None]
    forced = core.forced_mask(ids, meta["n"], plan.block, m.window, m.sink_blocks)
    out = []
    for i in range(len(plan.layers)):
        s = core.block_scores(core.query_mean(bufs["qring"][i]), bufs["units"][i], bufs["uok"][i])
        # recompute: blocks with keys at the pruning layer (their hidden state after it
        # exists); restrict: only blocks with KV at every layer of the stage
        elig = real if i == 0 else meta["havekv"][i - 1]
        elig = jnp.where(meta["restrict"], meta["havekv"][i], elig)
        nb = plan.blocks[i]
        idx, live = core.choose(s, forced, elig & real, jnp.full(ids.shape[:1], nb), nb)
        out.append((idx, live, jnp.where(elig & real, s, -jnp.inf)))
    return out


def step_fn(params, bufs, meta, logits, rng, done, *, cfg: ModelConfig, m, plan, sampling, sample):
    """One decoding step for every element: (token [B], next logits [B, V], buffers,
    candidates per stage, hidden states of revived groups after each stage)."""
    tok = jnp.where(done, cfg.pad_token_id, sample(logits, rng, sampling))
    live = ~done
    slot = bufs["gend"]
    qpos = bufs["next_pos"][:, None]
    gpos = bufs["gpos"].at[:, slot].set(bufs["next_pos"])
    gvalid = bufs["gvalid"].at[:, slot].set(live)
    gk, gv = bufs["gk"], bufs["gv"]
    x = params["embed"][tok][:, None]
    new = dict(bufs)
    ks, vs, xrs, units, uoks, rings = (list(bufs[k]) for k in
                                       ("ks", "vs", "xr", "units", "uok", "qring"))
    aux_out = []
    for i, (a, b) in enumerate(plan.stages):
        gen = (gk, gv, gpos, gvalid, slot)
        if i == 0:
            prompt = (bufs["k0"], bufs["v0"], meta["pos0"], meta["valid0"], None, None)
            x, gk, gv, _, _, _, qs = decode_stage(params, cfg, a, b, x, qpos, gen, prompt, False)
        else:
            rev = meta["rev"][i - 1]
            prompt = (ks[i - 1], vs[i - 1], meta["pos"][i - 1], meta["valid"][i - 1], rev,
                      xrs[i - 1])
            run = lambda revive, x, gen, prompt: decode_stage(params, cfg, a, b, x, qpos, gen,
                                                              prompt, revive)
            x, gk, gv, pk, pv, xr, qs = jax.lax.cond(
                jnp.any(rev), partial(run, True), partial(run, False), x, gen, prompt)
            ks[i - 1], vs[i - 1] = pk, pv
            if i < len(plan.layers):  # keys of the revived blocks at pruning layer p_{i+1}
                units[i], uoks[i] = _update_units(m, plan, units[i], uoks[i], pk[-1],
                                                  meta["valid"][i - 1], rev, meta["gblk"][i - 1])
                aux_out.append(xr)
        if i < len(plan.layers):
            rings[i] = push_ring(rings[i], qs[-1][:, 0], live)
    new.update(gk=gk, gv=gv, gpos=gpos, gvalid=gvalid, gend=slot + 1,
               next_pos=bufs["next_pos"] + live.astype(jnp.int32), ks=tuple(ks), vs=tuple(vs),
               units=tuple(units), uok=tuple(uoks),
               qring=jnp.stack(rings) if rings else bufs["qring"])
    logits = transformer.unembed(params, cfg, x[:, 0])
    return tok, logits, new, candidates(new, meta, m=m, plan=plan), tuple(aux_out)


def _update_units(m, plan, table, ok_table, k_BKSD, valid_BS, rev_BS, gblk_BG):
    """Write the unit keys of revived groups into the block-indexed table (others: dropped)."""
    rep, ok = core.unit_keys(k_BKSD, valid_BS, plan.block, m.unit)
    grev = jnp.any(rev_BS.reshape(rev_BS.shape[0], -1, plan.block), axis=-1)
    tgt = jnp.where(grev & (gblk_BG >= 0), gblk_BG, plan.num_blocks)  # out of range: dropped
    put = jax.vmap(lambda t, i, r: t.at[:, i].set(r, mode="drop"))
    put_ok = jax.vmap(lambda t, i, r: t.at[i].set(r, mode="drop"))
    return put(table, tgt, rep), put_ok(ok_table, tgt, ok)


# ---- buffers from the engine's cache ---------------------------------------------------------


def init_buffers(cache: kvcache.KVCache, state, *, m, plan, cfg: ModelConfig):
    """Split the engine's post-prefill cache into the stage buffers and build the tables."""
    Tp = plan.slots
    B = cache.k.shape[1]
    st = plan.stages
    ks = tuple(cache.k[a:b, :, :, : nb * plan.block] for (a, b), nb in zip(st[1:], plan.blocks))
    vs = tuple(cache.v[a:b, :, :, : nb * plan.block] for (a, b), nb in zip(st[1:], plan.blocks))
    M = plan.block // m.unit
    units, uoks = [], []
    for rep, blk in zip(state["units"], state["ublk"]):
        rep, ok = rep
        t = jnp.zeros((B, cfg.num_kv_heads, plan.num_blocks, M, cfg.head_dim), jnp.float32)
        units.append(jax.vmap(lambda t, i, r: t.at[:, i].set(r))(t, blk, rep))
        uoks.append(jax.vmap(lambda t, i, r: t.at[i].set(r))(
            jnp.zeros((B, plan.num_blocks, M), bool), blk, ok))
    a0, b0 = st[0]
    return {
        "k0": cache.k[a0:b0, :, :, :Tp], "v0": cache.v[a0:b0, :, :, :Tp], "ks": ks, "vs": vs,
        "gk": cache.k[:, :, :, Tp:], "gv": cache.v[:, :, :, Tp:],
        "gpos": cache.pos[0, :, 0, Tp:], "gvalid": cache.valid[0, :, 0, Tp:],
        "gend": cache.end - Tp, "next_pos": cache.next_pos,
        "units": tuple(units), "uok": tuple(uoks), "qring": state["qring"],
        "xr": tuple(jnp.zeros((B, nb * plan.block, cfg.hidden_size), cache.k.dtype)
                    for nb in plan.blocks),
    }


def assemble_cache(bufs, meta, *, plan, cfg: ModelConfig) -> kvcache.KVCache:
    """The device-resident view as one KVCache [L, B, K, T' + G]: stage 0 whole, each slim
    stage's active groups (padded), the generated tokens."""
    Tp, K = plan.slots, cfg.num_kv_heads
    pad = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, Tp - a.shape[3])] + [(0, 0)] * (a.ndim - 4))
    parts_k, parts_v, parts_p, parts_ok = [bufs["k0"]], [bufs["v0"]], [], []
    n0 = bufs["k0"].shape[0]
    parts_p.append(jnp.broadcast_to(meta["pos0"][None, :, None], (n0, *bufs["k0"].shape[1:4])))
    parts_ok.append(jnp.broadcast_to(meta["valid0"][None, :, None], parts_p[0].shape))
    for k, v, p, ok in zip(bufs["ks"], bufs["vs"], meta["pos"], meta["valid"]):
        parts_k.append(pad(k))
        parts_v.append(pad(v))
        parts_p.append(pad(jnp.broadcast_to(p[None, :, None], k.shape[:4])))
        parts_ok.append(pad(jnp.broadcast_to(ok[None, :, None], k.shape[:4])))
    L = cfg.num_layers
    g = lambda a: jnp.broadcast_to(a[None, :, None], (L, a.shape[0], K, a.shape[1]))
    cat = lambda parts, gen: jnp.concatenate([jnp.concatenate(parts, 0), gen], axis=3)
    return kvcache.KVCache(cat(parts_k, bufs["gk"]), cat(parts_v, bufs["gv"]),
                           cat(parts_p, g(bufs["gpos"])), cat(parts_ok, g(bufs["gvalid"])),
                           end=bufs["gend"] + Tp, next_pos=bufs["next_pos"])


# ---- moving one block (fixed shapes: compiled once per stage) ---------------------------------


@partial(jax.jit, static_argnames=("block",), donate_argnames=("k", "v"))
def place_block(k, v, kb, vb, elem, group, *, block: int):
    """Write one block's KV [n, K, block, Dh] into group `group` of element `elem`."""
    idx = (0, elem, 0, group * block, 0)
    return (jax.lax.dynamic_update_slice(k, kb[:, None].astype(k.dtype), idx),
            jax.lax.dynamic_update_slice(v, vb[:, None].astype(v.dtype), idx))


@partial(jax.jit, static_argnames=("block",))
def take_block(k, v, elem, group, *, block: int):
    n, _, K, _, D = k.shape
    idx = (0, elem, 0, group * block, 0)
    sl = lambda a: jax.lax.dynamic_slice(a, idx, (n, 1, K, block, D))[:, 0]
    return sl(k), sl(v)


@partial(jax.jit, static_argnames=("block",), donate_argnames=("x",))
def place_rows(x, rows, elem, group, *, block: int):
    """Write one block's hidden states [block, D] into group `group` of element `elem`."""
    return jax.lax.dynamic_update_slice(x, rows[None].astype(x.dtype), (elem, group * block, 0))


@partial(jax.jit, static_argnames=("block",))
def take_rows(x, elem, group, *, block: int):
    return jax.lax.dynamic_slice(x, (elem, group * block, 0), (1, block, x.shape[2]))[0]


def _ix(elem, group):
    return np.int32(elem), np.int32(group)


def movers(bufs, aux, *, plan, cfg: ModelConfig) -> tuple[list[dict], float]:
    """The per-block move functions of every slim stage, compiled before the timed loop
    (fixed shapes: one executable per stage and function)."""
    out, secs = [], 0.0
    for k, v, xr, ax in zip(bufs["ks"], bufs["vs"], bufs["xr"], aux):
        kb = jnp.zeros((k.shape[0], k.shape[2], plan.block, k.shape[4]), k.dtype)
        rows = jnp.zeros((plan.block, xr.shape[2]), xr.dtype)
        fns = {}
        for name, fn, args in (("place_block", place_block, (k, v, kb, kb)),
                               ("take_block", take_block, (k, v)),
                               ("place_rows", place_rows, (xr, rows)),
                               ("take_rows", take_rows, (xr,)),
                               ("take_aux", take_rows, (ax,))):
            fns[name], c = compile_once(fn, (*args, *_ix(0, 0)), block=plan.block)
            secs += c
        out.append(fns)
    return out, secs


# ---- the host loop ---------------------------------------------------------------------------


class SlimDecodeState:
    """Host bookkeeping of one generation: the active group layout per stage, which blocks
    have KV where, the host store, the per-step history and the counters."""

    def __init__(self, m, plan, cfg, state, B: int, itemsize: int):
        self.m, self.plan, self.cfg = m, plan, cfg
        self.n = np.asarray(state["n"])
        P = len(plan.layers)
        blocks = [np.asarray(b) for b in state["blocks"]]
        blive = [np.asarray(b) for b in state["blive"]]
        self.gblk = [np.where(lv, b, -1).astype(np.int32) for b, lv in zip(blocks, blive)]
        # blocks with KV at (every layer of) stage i+1, i.e. behind slim stage i
        self.havekv = [np.zeros((B, plan.num_blocks), bool) for _ in range(P)]
        for i in range(P):
            for e in range(B):
                self.havekv[i][e, self.gblk[i][e][self.gblk[i][e] >= 0]] = True
        self.store = offload.HostStore()
        self.in_host = [[set() for _ in range(B)] for _ in range(P)]
        self.rev = [np.zeros((B, nb * plan.block), bool) for nb in plan.blocks]
        self.history: list[list[np.ndarray]] = []  # per step: active block ids per stage [B, nb]
        self.cand_history: list[list[np.ndarray]] = []
        self.swaps = np.zeros((B, P), np.int64)
        self.fetched = np.zeros(B, np.int64)
        self.revived = np.zeros(B, np.int64)
        self.offloaded = np.zeros(B, np.int64)
        self.bytes_h2d = np.zeros(B, np.int64)
        self.bytes_d2h = np.zeros(B, np.int64)
        self.prefill_d2h = np.zeros(B, np.int64)
        self.device_kv = []  # per step [B]: live device-resident KV bytes
        self.full_kv = []
        self.slot_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
        self.steps = 0
        self.swap_steps = np.zeros(B, np.int64)  # steps before which any stage swapped

    def pos_valid(self, i: int):
        """Positions and validity of stage i+1's active slots from the group layout."""
        bs = self.plan.block
        g = self.gblk[i]
        pos = (np.maximum(g, 0)[:, :, None] * bs + np.arange(bs)).reshape(g.shape[0], -1)
        valid = (np.repeat(g >= 0, bs, axis=1)) & (pos < self.n[:, None])
        return pos.astype(np.int32), valid

    def meta(self, static) -> dict:
        pv = [self.pos_valid(i) for i in range(len(self.plan.layers))]
        return {**static, "restrict": jnp.asarray(self.m.decode == "restrict"),
                "pos": tuple(jnp.asarray(p) for p, _ in pv),
                "valid": tuple(jnp.asarray(v) for _, v in pv),
                "rev": tuple(jnp.asarray(r) for r in self.rev),
                "gblk": tuple(jnp.asarray(g) for g in self.gblk),
                "havekv": tuple(jnp.asarray(h) for h in self.havekv)}


def _offload_prefill_aux(hs: SlimDecodeState, state):
    """Hidden states at each slim stage's input of the blocks pruned there (the aux cache)."""
    bs = hs.plan.block
    for i, (aux, blk) in enumerate(zip(state["aux"], state["ublk"])):
        blk = np.asarray(blk)
        for e in range(blk.shape[0]):
            for g, b in enumerate(blk[e]):
                if b * bs < hs.n[e] and not hs.havekv[i][e, b] and \
                        (i == 0 or hs.havekv[i - 1][e, b]):
                    rows = hs.movers[i]["take_aux"](aux, *_ix(e, g))
                    hs.prefill_d2h[e] += hs.store.put(("aux", i, e, int(b)), rows)


def _swap(hs: SlimDecodeState, bufs, cands, done):
    """Algorithm 1 for every (stage, element) with the candidates of the last step."""
    m, bs = hs.m, hs.plan.block
    swapped_any = np.zeros(len(done), bool)
    for i, (idx, live) in enumerate(cands):
        ks, vs, xrs = list(bufs["ks"]), list(bufs["vs"]), list(bufs["xr"])
        hs.rev[i][:] = False
        for e in np.flatnonzero(~done):
            g = hs.gblk[i][e]
            active = set(int(b) for b in g if b >= 0)
            cand = set(int(b) for b, ok in zip(idx[e], live[e]) if ok)
            d = offload.overlap_test(active, cand, m.gamma, hs.in_host[i][e])
            if not d.swapped:
                continue
            hs.swaps[e, i] += 1
            swapped_any[e] = True
            free = []
            for b in d.leave:
                grp = int(np.flatnonzero(g == b)[0])
                if b in d.offload:  # revived here, never offloaded: copy out before reuse
                    kb, vb = hs.movers[i]["take_block"](ks[i], vs[i], *_ix(e, grp))
                    nbts = hs.store.put(("kv", i, e, b), (kb, vb))
                    hs.bytes_d2h[e] += nbts
                    hs.offloaded[e] += 1
                    hs.in_host[i][e].add(b)
                g[grp] = -1
                free.append(grp)
            free += [int(x) for x in np.flatnonzero(g == -1) if x not in free]
            for b, grp in zip(d.load, sorted(free)):
                g[grp] = b
                if hs.havekv[i][e, b]:  # its KV at this stage exists: fetch it
                    kb, vb = hs.store.get(("kv", i, e, b))
                    ks[i], vs[i] = hs.movers[i]["place_block"](ks[i], vs[i], kb, vb, *_ix(e, grp))
                    hs.bytes_h2d[e] += offload.nbytes((kb, vb))
                    hs.fetched[e] += 1
                else:  # pruned before this stage: recompute from its hidden state
                    rows = hs.store.get(("aux", i, e, b))
                    xrs[i] = hs.movers[i]["place_rows"](xrs[i], rows, *_ix(e, grp))
                    hs.bytes_h2d[e] += offload.nbytes(rows)
                    hs.rev[i][e, grp * bs:(grp + 1) * bs] = True
                    hs.havekv[i][e, b] = True
                    hs.revived[e] += 1
        bufs = {**bufs, "ks": tuple(ks), "vs": tuple(vs), "xr": tuple(xrs)}
    return bufs, swapped_any


def _offload_revived_aux(hs: SlimDecodeState, aux_out, rev_before):
    """Revived blocks' hidden states after their stage: the next stage's aux cache."""
    bs = hs.plan.block
    for i, xr in enumerate(aux_out):  # stage i+1 -> aux of stage i+2
        grev = rev_before[i].reshape(rev_before[i].shape[0], -1, bs).any(-1)
        for e, grp in zip(*np.nonzero(grev)):
            b = int(hs.gblk[i][e, grp])
            if not hs.havekv[i + 1][e, b]:
                rows = hs.movers[i]["take_rows"](xr, *_ix(e, grp))
                hs.bytes_d2h[e] += hs.store.put(("aux", i + 1, e, b), rows)


def _account(hs: SlimDecodeState, bufs_gen_count):
    """Live device-resident KV bytes per element now, and what a full cache would hold."""
    (a0, b0) = hs.plan.stages[0]
    dev = (b0 - a0) * hs.n
    for i, (a, b) in enumerate(hs.plan.stages[1:]):
        dev = dev + (b - a) * hs.pos_valid(i)[1].sum(axis=1)
    L = hs.cfg.num_layers
    dev = dev + L * bufs_gen_count
    hs.device_kv.append(dev * hs.slot_bytes)
    hs.full_kv.append(L * (hs.n + bufs_gen_count) * hs.slot_bytes)


_step = jax.jit(step_fn, static_argnames=("cfg", "m", "plan", "sampling", "sample"),
                donate_argnames=("bufs",))
_init = jax.jit(init_buffers, static_argnames=("m", "plan", "cfg"))
_candidates = jax.jit(candidates, static_argnames=("m", "plan"))
_assemble = jax.jit(assemble_cache, static_argnames=("plan", "cfg"))


def run_decode(m, params, cfg: ModelConfig, cache, logits, rng, state, *, max_new: int,
               sampling, stop_ids, sample: Callable):
    """The method-owned decode loop (`Method.decode_driver`): host loop over one compiled step.

    Returns (tokens [B, max_new], generated counts [B], the device-resident cache view, the
    host state `SlimDecodeState`, stats incl. `compile_s` and `decode_s`)."""
    B = logits.shape[0]
    plan = m.plan(cfg, int(state["T"]))
    hs = SlimDecodeState(m, plan, cfg, state, B, cache.k.dtype.itemsize)
    init, compile_s = compile_once(_init, (cache, state), m=m, plan=plan, cfg=cfg)
    t0 = time.perf_counter()
    bufs = jax.block_until_ready(init(cache, state))
    setup_s = time.perf_counter() - t0
    static = {"pos0": cache.pos[0, :, 0, : plan.slots], "n": jnp.asarray(hs.n),
              "valid0": cache.valid[0, :, 0, : plan.slots]}
    meta = hs.meta(static)
    done = np.zeros(B, bool)
    kw = dict(cfg=cfg, m=m, plan=plan, sampling=sampling, sample=sample)
    step, c = compile_once(_step, (params, bufs, meta, logits, rng, jnp.asarray(done)), **kw)
    compile_s += c
    first, c = compile_once(_candidates, (bufs, meta), m=m, plan=plan)
    compile_s += c
    hs.movers, c = movers(bufs, state["aux"], plan=plan, cfg=cfg)
    compile_s += c
    keys = list(jax.random.split(rng, max_new))
    t1 = time.perf_counter()
    _offload_prefill_aux(hs, state)
    cands = [(np.asarray(i), np.asarray(lv)) for i, lv, _ in first(bufs, meta)]
    out = np.full((B, max_new), cfg.pad_token_id, np.int32)
    n_gen = np.zeros(B, np.int64)
    stops = np.asarray(stop_ids or (-1,))
    gen_count = np.asarray(bufs["gvalid"]).sum(axis=1)
    for t in range(max_new):
        bufs, swapped = _swap(hs, bufs, cands, done)
        hs.swap_steps += swapped
        meta = hs.meta(static)
        rev_before = [r.copy() for r in hs.rev]
        hs.history.append([g.copy() for g in hs.gblk])
        tok, logits, bufs, c, aux_out = step(params, bufs, meta, logits, keys[t], jnp.asarray(done))
        tok = np.asarray(tok)
        out[:, t] = tok
        live = ~done
        gen_count = gen_count + live
        _account(hs, gen_count)
        stopped = np.isin(tok, stops)
        n_gen += live & ~stopped
        done = done | stopped
        cands = [(np.asarray(i), np.asarray(lv)) for i, lv, _ in c]
        hs.cand_history.append([i for i, _ in cands])
        _offload_revived_aux(hs, aux_out, rev_before)
        hs.steps += 1
        if done.all():
            break
    jax.block_until_ready(bufs)
    decode_s = time.perf_counter() - t1 + setup_s
    hs.cache = _assemble(bufs, hs.meta(static), plan=plan, cfg=cfg)
    return out, n_gen, hs.cache, hs, {**_stats(hs), "compile_s": compile_s, "decode_s": decode_s}


def _stats(hs: SlimDecodeState) -> dict:
    steps = max(hs.steps, 1)
    P = len(hs.plan.layers)
    dev = np.mean(hs.device_kv, axis=0) if hs.device_kv else np.zeros(hs.n.shape[0])
    full = np.mean(hs.full_kv, axis=0) if hs.full_kv else np.zeros(hs.n.shape[0])
    return {
        "decode_steps": [hs.steps] * hs.n.shape[0],
        "swaps": hs.swaps.tolist(),
        "swap_step_fraction": (hs.swap_steps / steps).tolist(),
        "swap_fraction": (hs.swaps.sum(axis=1) / (steps * max(P, 1))).tolist(),
        "blocks_fetched": hs.fetched.tolist(),
        "blocks_revived": hs.revived.tolist(),
        "blocks_offloaded": hs.offloaded.tolist(),
        "bytes_h2d": hs.bytes_h2d.tolist(),
        "bytes_d2h": hs.bytes_d2h.tolist(),
        "bytes_per_step": ((hs.bytes_h2d + hs.bytes_d2h) / steps).tolist(),
        "prefill_offload_bytes": hs.prefill_d2h.tolist(),
        "device_kv_bytes": dev.tolist(),
        "device_kv_bytes_full": full.tolist(),
        "host_store_bytes": [hs.store.resident_bytes(lambda k, e=e: k[2] == e)
                             for e in range(hs.n.shape[0])],
        "host_memory_kind": [hs.store.kind or "numpy"] * hs.n.shape[0],
    }
