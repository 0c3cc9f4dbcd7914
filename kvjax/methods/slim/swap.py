"""SlimInfer decoding: block re-selection at every step, KV of inactive blocks in host memory.

The engine runs the decode (its host loop of compiled steps, `Method.steps_on_host`); this
module supplies SlimInfer's hooks. The cache is the engine's: at a slim stage's layers the
first `blocks[i] * block` slots hold the stage's active blocks, one group of `block` slots
each (which block sits in which group is host bookkeeping, `gblk`), then dead slots, then
the generated tokens (appended at every layer, never pruned). Stage 0 (the preserve
layers) holds every prompt block.

One step (the engine's): the new token goes through every layer. Before a slim stage's
layer attends, blocks being *revived* (no KV at this stage yet: pruned at prefill) have
their KV computed there from their hidden state at the stage input (LazyLLM's aux cache):
the engine's `revival` rows, each layer run on them over the layer's cache, so their KV
exists before the new token attends. After the step (`after_step`, compiled) each stage's
candidate blocks are scored (Eq. 2) with the mean of the last w queries at its pruning
layer, over the unit keys (Eq. 1) of every block that has keys there: 1/unit of one
layer's keys per block, Quest-style metadata kept on device so that inactive blocks can
be scored.

Between steps (`between_steps`, on the host): Algorithm 1 per stage and element; blocks
that leave are copied to host memory unless it holds them, blocks that enter are fetched
from it (or revived from their hidden state), each move one compiled, donated update of
the cache (compiled once per stage).

Timing (`decode_timing`): "paper" -- stage i's candidates are scored right after pruning
layer p_i with the query window that ends at the token being decoded, and decide the
blocks that token attends to at stage i's layers: the engine splits each step at the
pruning layers (`decode_segments`) and swaps in between (`between_segments`), so a step
is P + 1 compiled calls with a host sync at each pruning layer (the paper prefetches
during that layer's FFN instead). "lagged" -- one compiled call per step; the candidates
computed in step t decide the active sets of step t+1, so the window that chooses the
blocks of token t+1 ends at token t.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.compression.layer import Revival
from kvjax.config import ModelConfig
from kvjax.methods.slim import blocks, host_store

# ---- device state --------------------------------------------------------------------------


def _block_table(rep_BKGMD, blk_BG, NB: int):
    """Per-group unit keys [B, K, G, M, Dh] -> a table indexed by block id [B, K, NB, M, Dh]."""
    B, K, _, M, Dh = rep_BKGMD.shape
    t = jnp.zeros((B, K, NB, M, Dh), jnp.float32)
    return jax.vmap(lambda t, i, r: t.at[:, i].set(r))(t, blk_BG, rep_BKGMD)


def prefill_state(plan: blocks.Plan, n_B, pruned: list[dict], unit: int) -> dict:
    """The decode state the block-pruning prefill leaves (traced): per pruning layer its
    query ring, the unit keys of every block it saw (by block id), the kept groups, and
    the stage-input hidden states `aux` of every block it saw (offloaded by `init_host`)."""
    NB, M = plan.num_blocks, plan.block // unit
    B = n_B.shape[0]
    return {
        "n": n_B,
        "players": jnp.asarray(plan.layers, jnp.int32),
        "qring": jnp.stack([p["qring"] for p in pruned]) if pruned else None,
        "units": jnp.stack([_block_table(p["units"][0], p["ublk"], NB) for p in pruned]),
        "uok": jnp.stack([jax.vmap(lambda t, i, r: t.at[i].set(r))(
            jnp.zeros((B, NB, M), bool), p["ublk"], p["units"][1]) for p in pruned]),
        "groups": tuple(jnp.where(p["blive"], p["blocks"], -1) for p in pruned),
        "aux": tuple(p["aux"] for p in pruned),
        "ublk": tuple(p["ublk"] for p in pruned),
    }


def _stage(layer, players):
    """The slim stage index of a (traced) layer: -1 for stage 0's layers."""
    return jnp.sum(players < layer) - 1


def revival(layer, state, split: bool):
    """`Method.revival`: the revived rows of this layer's stage and their stage-input
    hidden states (rows are the stage's group slots). `split` (pruning right after the
    pruning layer's attention): the stored states stop before the pruning layer's MLP, so
    the stage's first layer runs it first, and its last layer stops after its attention
    (the next stage's aux cache holds that state)."""
    if "xr" not in state:  # the prefill's state (a context-only question chunk)
        return None
    if state["ridx"].shape[-1] == 0:  # nothing revived this step: the step compiles without
        return None  # revival (its cond and row scatters were most of a step's excess on CPU)
    players = state["players"]
    i = _stage(layer, players)
    P = state["rev"].shape[0]
    j = jnp.clip(i, 0, P - 1)
    slot = state["ridx"][j]  # [B, Rc] the revived rows only (-1: none), not all R
    x = jnp.take_along_axis(state["xr"][j], jnp.maximum(slot, 0)[..., None], axis=1)
    first = layer == players[j] + 1
    last = (i < P - 1) & (layer == players[jnp.clip(i + 1, 0, P - 1)])
    # the rows attend to their stage's prompt blocks, which fill the first R slots of its
    # layers (generated tokens come later in position, so the causal mask drops them)
    return Revival(x, slot, (i >= 0) & jnp.any(slot >= 0), split & first, ~(split & last),
                   keys=state["rev"].shape[2])


def revived(layer, x_BRD, state):
    """`Method.revived`: the revived rows' hidden states after this layer (x_BRD: the
    rows of `revival`, back into their places of the stage's [B, R, D])."""
    xr = state["xr"]
    j = jnp.clip(_stage(layer, state["players"]), 0, xr.shape[0] - 1)
    slot = state["ridx"][j]
    rows = jnp.where(slot >= 0, slot, xr.shape[2])  # out of range: dropped
    new = jax.vmap(lambda t, r, x: t.at[r].set(x, mode="drop"))(
        xr[j], rows, x_BRD.astype(xr.dtype))
    return {**state, "xr": xr.at[j].set(new)}


def revived_rows(rev_PBR: np.ndarray, block: int) -> np.ndarray:
    """[P, B, Rc] the indices of each stage's and element's revived rows, ascending, -1
    after them; Rc the fewest of block * 2^k (at most R) that hold the most revived, 0 when
    nothing is revived (most steps: that step has no revival at all). The engine computes
    revival for these rows alone: all R rows cost 9x a step without revival on SmolLM2 at
    1024 (a block or two is what a step usually revives). Each Rc is its own compiled
    step, so it takes few values."""
    P, B, R = rev_PBR.shape
    most = int(rev_PBR.sum(-1).max()) if rev_PBR.size else 0
    if most == 0:
        return np.full((P, B, 0), -1, np.int32)
    rc = block
    while rc < min(most, R):
        rc *= 2
    rc = min(rc, R)
    idx = np.argsort(~rev_PBR, axis=-1, kind="stable")[..., :rc]  # revived first, ascending
    return np.where(np.take_along_axis(rev_PBR, idx, -1), idx, -1).astype(np.int32)


def decode_plan(m, cfg: ModelConfig, state) -> blocks.Plan:
    """The static plan of a decode state (from its shapes: the padded length is not kept)."""
    layers = m.stage_layers(cfg)
    return blocks.Plan(cfg.num_layers, m.block, m.window, state["units"].shape[3], layers,
                       tuple(idx.shape[1] for idx, _ in state["cand"]), m.keep_ratio,
                       m.prune_after)


def candidates(m, plan: blocks.Plan, state, stages=None):
    """Per stage i >= 1 (default: all): the candidate blocks [B, blocks[i]] (ascending ids)
    and which are live, from the last w queries and the unit keys at its pruning layer."""
    n = state["n"]
    NB = plan.num_blocks
    ids = jnp.broadcast_to(jnp.arange(NB, dtype=jnp.int32), (n.shape[0], NB))
    real = ids * plan.block < n[:, None]
    forced = blocks.forced_mask(ids, n, plan.block, m.window, m.sink_blocks,
                                m.decode_forced == "sink_and_tail")
    out = []
    for i in range(len(plan.blocks)) if stages is None else stages:
        nb = plan.blocks[i]
        s = blocks.block_scores(blocks.query_mean(state["qring"][i]), state["units"][i],
                                state["uok"][i])
        # recompute: blocks with keys at the pruning layer (their hidden state after it
        # exists); restrict: only blocks with KV at every layer of the stage
        elig = real if i == 0 else state["havekv"][i - 1]
        elig = jnp.where(state["restrict"], state["havekv"][i], elig)
        idx, live = blocks.choose(s, forced, elig & real, jnp.full(ids.shape[:1], nb), nb)
        out.append((idx, live))
    return tuple(out)


def after_layers(m, cfg: ModelConfig, cache, state, upto: int):
    """`Method.after_layers`: for every stage i whose pruning layer p_i is now done (all
    of them at the end of a step with the lagged timing; the one with p_i = upto - 1 inside
    a step with the paper's): the unit keys at p_i of the blocks revived at the stage
    before (their keys there exist now), then stage i's candidates."""
    plan = decode_plan(m, cfg, state)
    if m.decode_timing == "lagged":
        stages = list(range(len(plan.layers))) if upto == cfg.num_layers else []
    else:
        stages = [i for i, p in enumerate(plan.layers) if p == upto - 1]
    if not stages:
        return state
    units, uok = state["units"], state["uok"]
    B = cache.k.shape[1]
    for i in stages:
        if i == 0:  # stage 0 holds every block: no revival before p_1
            continue
        R = plan.blocks[i - 1] * plan.block
        p = plan.layers[i]
        rep, ok = blocks.unit_keys(cache.k[p, :, :, :R], cache.valid[p, :, 0, :R], plan.block,
                                   m.unit)
        grev = jnp.any(state["rev"][i - 1][:, :R].reshape(B, -1, plan.block), axis=-1)
        gblk = state["gblk"][i - 1][:, : plan.blocks[i - 1]]
        tgt = jnp.where(grev & (gblk >= 0), gblk, plan.num_blocks)  # out of range: dropped
        units = units.at[i].set(jax.vmap(lambda t, j, r: t.at[:, j].set(r, mode="drop"))(
            units[i], tgt, rep))
        uok = uok.at[i].set(jax.vmap(lambda t, j, r: t.at[j].set(r, mode="drop"))(
            uok[i], tgt, ok))
    state = {**state, "units": units, "uok": uok}
    cand = list(state["cand"])
    for i, c in zip(stages, candidates(m, plan, state, stages)):
        cand[i] = c
    return {**state, "cand": tuple(cand)}


# ---- moving one block (fixed shapes: compiled once per stage) ---------------------------------


@partial(jax.jit, static_argnames=("a", "b", "block"), donate_argnames=("cache",))
def place_block(cache, kb, vb, elem, group, *, a: int, b: int, block: int):
    """Write one block's KV [n, K, block, Dh] into group `group` of element `elem` at the
    stage's layers [a, b)."""
    idx = (a, elem, 0, group * block, 0)
    put = lambda x, y: jax.lax.dynamic_update_slice(x, y[:, None].astype(x.dtype), idx)  # noqa: E731
    return dataclasses.replace(cache, k=put(cache.k, kb), v=put(cache.v, vb))


@partial(jax.jit, static_argnames=("a", "b", "block"))
def take_block(cache, elem, group, *, a: int, b: int, block: int):
    _, _, K, _, D = cache.k.shape
    idx = (a, elem, 0, group * block, 0)
    sl = lambda x: jax.lax.dynamic_slice(x, idx, (b - a, 1, K, block, D))[:, 0]  # noqa: E731
    return sl(cache.k), sl(cache.v)


@partial(jax.jit, static_argnames=("a", "b"), donate_argnames=("cache",))
def set_slots(cache, pos_S, valid_S, elem, *, a: int, b: int):
    """Positions and validity of one element's group slots [S] at the stage's layers."""
    L, _, K, _ = cache.pos.shape
    S = pos_S.shape[0]
    put = lambda x, y: jax.lax.dynamic_update_slice(  # noqa: E731
        x, jnp.broadcast_to(y.astype(x.dtype), (b - a, 1, K, S)), (a, elem, 0, 0))
    return dataclasses.replace(cache, pos=put(cache.pos, pos_S), valid=put(cache.valid, valid_S))


@partial(jax.jit, static_argnames=("block",), donate_argnames=("x",))
def place_rows(x, rows, stage, elem, group, *, block: int):
    """Write one block's hidden states [block, D] into a stage's revival rows [P, B, R, D]."""
    return jax.lax.dynamic_update_slice(x, rows[None, None].astype(x.dtype),
                                        (stage, elem, group * block, 0))


@partial(jax.jit, static_argnames=("block",))
def take_rows(x, elem, group, *, block: int):
    """One block's rows [block, D] of hidden states [B, S, D]."""
    return jax.lax.dynamic_slice(x, (elem, group * block, 0), (1, block, x.shape[2]))[0]


def _ix(*xs):
    return tuple(np.int32(x) for x in xs)


# ---- host bookkeeping -----------------------------------------------------------------------


class SlimDecodeState:
    """Host bookkeeping of one generation: the active group layout per stage, which blocks
    have KV where, the host store, the per-step history and the counters."""

    def __init__(self, m, plan: blocks.Plan, cfg: ModelConfig, groups, n, B: int,
                 itemsize: int):
        self.m, self.plan, self.cfg = m, plan, cfg
        self.n = np.asarray(n)
        P = len(plan.layers)
        self.gblk = [np.asarray(g).astype(np.int32) for g in groups]
        # blocks with KV at (every layer of) stage i+1, i.e. behind slim stage i
        self.havekv = [np.zeros((B, plan.num_blocks), bool) for _ in range(P)]
        for i in range(P):
            for e in range(B):
                self.havekv[i][e, self.gblk[i][e][self.gblk[i][e] >= 0]] = True
        self.store = host_store.HostStore()
        self.in_host = [[set() for _ in range(B)] for _ in range(P)]
        self.rev = [np.zeros((B, nb * plan.block), bool) for nb in plan.blocks]
        self.step_swapped = np.zeros(B, bool)
        self.history: list[list[np.ndarray]] = []  # per step: active block ids per stage [B, nb]
        self.cand_history: list[list[np.ndarray]] = []
        self.cands: list = []
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
        self.pending = False  # a step ran whose outputs are not read yet
        self.live = np.zeros(B, bool)
        self.gen_count = np.zeros(B, np.int64)
        self.swap_steps = np.zeros(B, np.int64)  # steps before which any stage swapped
        self.movers: list[dict] = []

    def pos_valid(self, i: int):
        """Positions and validity of stage i+1's group slots from the group layout."""
        bs = self.plan.block
        g = self.gblk[i]
        pos = (np.maximum(g, 0)[:, :, None] * bs + np.arange(bs)).reshape(g.shape[0], -1)
        valid = (np.repeat(g >= 0, bs, axis=1)) & (pos < self.n[:, None])
        return pos.astype(np.int32), valid

    def device(self, state: dict) -> dict:
        """The host-maintained parts of the decode state, as device arrays."""
        R = state["rev"].shape[2]
        nbmax = state["gblk"].shape[2]
        pad = lambda a, w, v: np.pad(a, [(0, 0), (0, w - a.shape[1])], constant_values=v)  # noqa: E731
        rev = np.stack([pad(r, R, False) for r in self.rev])
        return {**state, "rev": jnp.asarray(rev),
                "ridx": jnp.asarray(revived_rows(rev, self.plan.block)),
                "gblk": jnp.asarray(np.stack([pad(g, nbmax, -1) for g in self.gblk])),
                "havekv": jnp.asarray(np.stack(self.havekv))}


def init_host(m, cfg: ModelConfig, cache, state, compile):
    """`Method.init_host`: the host bookkeeping, the prefill's aux cache offloaded, the
    per-block movers compiled, and the decode state. `compile` is the engine's AOT
    compiler (`compile_once`); returns (host, state, compile seconds)."""
    B = cache.k.shape[1]
    P = len(state["groups"])
    NB = state["units"].shape[3]
    layers = m.stage_layers(cfg)
    plan = blocks.Plan(cfg.num_layers, m.block, m.window, NB, layers,
                       tuple(g.shape[1] for g in state["groups"]), m.keep_ratio, m.prune_after)
    hs = SlimDecodeState(m, plan, cfg, state["groups"], state["n"], B, cache.k.dtype.itemsize)
    R = max(plan.blocks) * plan.block
    D = cfg.hidden_size
    xr = jnp.zeros((P, B, R, D), cache.k.dtype)
    secs = 0.0

    def compiled(fn, args, **static):
        nonlocal secs
        exe, s, _ = compile(fn, args, **static)
        secs += s
        return exe

    kb = lambda a, b: jnp.zeros((b - a, cache.k.shape[2], plan.block, cache.k.shape[4]),  # noqa: E731
                                cache.k.dtype)
    for i, (a, b) in enumerate(plan.stages[1:]):
        S = plan.blocks[i] * plan.block
        hs.movers.append({
            "place_block": compiled(place_block, (cache, kb(a, b), kb(a, b), *_ix(0, 0)),
                                    a=a, b=b, block=plan.block),
            "take_block": compiled(take_block, (cache, *_ix(0, 0)), a=a, b=b, block=plan.block),
            "set_slots": compiled(set_slots, (cache, jnp.zeros(S, jnp.int32),
                                              jnp.zeros(S, bool), *_ix(0)), a=a, b=b),
            "take_aux": compiled(take_rows, (state["aux"][i], *_ix(0, 0)), block=plan.block),
        })
    hs.place_rows = compiled(place_rows, (xr, jnp.zeros((plan.block, D), xr.dtype),
                                          *_ix(0, 0, 0)), block=plan.block)
    hs.take_rows = compiled(take_rows, (xr[0], *_ix(0, 0)), block=plan.block)
    first = compiled(_candidates_fn, (state["qring"], state["units"], state["uok"], state["n"],
                                      jnp.zeros((P, B, NB), bool), jnp.bool_(False)),
                     m=m, plan=plan)
    _offload_prefill_aux(hs, state)
    nbmax = max(plan.blocks)
    dec = {k: state[k] for k in ("n", "players", "qring", "units", "uok")}
    dec.update(rev=jnp.zeros((P, B, R), bool), xr=xr, gblk=jnp.zeros((P, B, nbmax), jnp.int32),
               havekv=jnp.zeros((P, B, NB), bool), restrict=jnp.asarray(m.decode == "restrict"))
    dec = hs.device(dec)
    dec["cand"] = first(dec["qring"], dec["units"], dec["uok"], dec["n"], dec["havekv"],
                        dec["restrict"])
    hs.cands = [(np.asarray(i), np.asarray(lv)) for i, lv in dec["cand"]]
    hs.gen_count = np.asarray(cache.valid[0, :, 0, plan.slots:]).sum(axis=1)
    return hs, dec, secs


@partial(jax.jit, static_argnames=("m", "plan"))
def _candidates_fn(qring, units, uok, n, havekv, restrict, *, m, plan):
    return candidates(m, plan, {"qring": qring, "units": units, "uok": uok, "n": n,
                                "havekv": havekv, "restrict": restrict})


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


def _swap(hs: SlimDecodeState, cache, state, done, stages):
    """Algorithm 1 for every element of the given stages, with their current candidates."""
    m, bs = hs.m, hs.plan.block
    swapped_any = np.zeros(len(done), bool)
    xr = state["xr"]
    for i in stages:
        idx, live = hs.cands[i]
        mv = hs.movers[i]
        hs.rev[i][:] = False
        for e in np.flatnonzero(~done):
            g = hs.gblk[i][e]
            active = set(int(x) for x in g if x >= 0)
            cand = set(int(x) for x, ok in zip(idx[e], live[e]) if ok)
            d = host_store.overlap_test(active, cand, m.gamma, hs.in_host[i][e])
            if not d.swapped:
                continue
            hs.swaps[e, i] += 1
            swapped_any[e] = True
            free = []
            for blk in d.leave:
                grp = int(np.flatnonzero(g == blk)[0])
                if blk in d.offload:  # revived here, never offloaded: copy out before reuse
                    kv = mv["take_block"](cache, *_ix(e, grp))
                    hs.bytes_d2h[e] += hs.store.put(("kv", i, e, blk), kv)
                    hs.offloaded[e] += 1
                    hs.in_host[i][e].add(blk)
                g[grp] = -1
                free.append(grp)
            free += [int(x) for x in np.flatnonzero(g == -1) if x not in free]
            for blk, grp in zip(d.load, sorted(free)):
                g[grp] = blk
                if hs.havekv[i][e, blk]:  # its KV at this stage exists: fetch it
                    kb, vb = hs.store.get(("kv", i, e, blk))
                    cache = mv["place_block"](cache, kb, vb, *_ix(e, grp))
                    hs.bytes_h2d[e] += host_store.nbytes((kb, vb))
                    hs.fetched[e] += 1
                else:  # pruned before this stage: recompute from its hidden state
                    rows = hs.store.get(("aux", i, e, blk))
                    xr = hs.place_rows(xr, rows, *_ix(i, e, grp))
                    hs.bytes_h2d[e] += host_store.nbytes(rows)
                    hs.rev[i][e, grp * bs:(grp + 1) * bs] = True
                    hs.havekv[i][e, blk] = True
                    hs.revived[e] += 1
            pos, valid = hs.pos_valid(i)
            cache = mv["set_slots"](cache, jnp.asarray(pos[e]), jnp.asarray(valid[e]), *_ix(e))
    hs.swap_steps += swapped_any & ~hs.step_swapped
    hs.step_swapped |= swapped_any
    return cache, {**state, "xr": xr}


def _read_candidates(hs: SlimDecodeState, state, stages):
    hs.cands = [(np.asarray(i), np.asarray(lv)) if s in stages else hs.cands[s]
                for s, (i, lv) in enumerate(state["cand"])]


def _after(hs: SlimDecodeState, state):
    """What the host reads of the step that just ran: live device KV, the candidates (for
    the lagged timing's next step), and the revived blocks' hidden states after their stage
    (the next stage's aux cache)."""
    hs.gen_count = hs.gen_count + hs.live
    _account(hs)
    if hs.m.decode_timing == "lagged":
        _read_candidates(hs, state, range(len(hs.plan.layers)))
        hs.cand_history.append([i for i, _ in hs.cands])
        for i in range(len(hs.plan.layers) - 1):
            _offload_revived_aux(hs, state, i)
    hs.steps += 1
    hs.pending = False


def _offload_revived_aux(hs: SlimDecodeState, state, i: int):
    """The hidden states after slim stage i of the blocks revived there this step: the aux
    cache of stage i + 1 (where they have no KV yet)."""
    bs = hs.plan.block
    grev = hs.rev[i].reshape(hs.rev[i].shape[0], -1, bs).any(-1)
    for e, grp in zip(*np.nonzero(grev)):
        b = int(hs.gblk[i][e, grp])
        if not hs.havekv[i + 1][e, b]:
            rows = hs.take_rows(state["xr"][i], *_ix(e, grp))
            hs.bytes_d2h[e] += hs.store.put(("aux", i + 1, e, b), rows)


def between_steps(hs: SlimDecodeState, cache, state, done):
    """`Method.between_steps`: read the last step; with the lagged timing, swap every stage
    for the next one with its candidates."""
    if hs.pending:
        _after(hs, state)
    hs.live = ~np.asarray(done)
    hs.pending = True
    hs.step_swapped = np.zeros(len(done), bool)
    if hs.m.decode_timing == "lagged":
        cache, state = _swap(hs, cache, state, done, range(len(hs.plan.layers)))
        hs.history.append([g.copy() for g in hs.gblk])
    else:
        for r in hs.rev:
            r[:] = False
    return cache, hs.device(state)


def between_segments(hs: SlimDecodeState, i: int, cache, state, done):
    """`Method.between_segments` (the paper's timing): after pruning layer p_i, stage i's
    candidates from this token's queries decide its active blocks for this token (blocks
    revived at stage i - 1 in this step may be chosen: their aux cache is written first)."""
    if i:
        _offload_revived_aux(hs, state, i - 1)
    _read_candidates(hs, state, [i])
    cache, state = _swap(hs, cache, state, done, [i])
    if i == len(hs.plan.layers) - 1:
        hs.history.append([g.copy() for g in hs.gblk])
        hs.cand_history.append([c for c, _ in hs.cands])
    return cache, hs.device(state)


def _account(hs: SlimDecodeState):
    """Live device-resident KV bytes per element now, and what a full cache would hold."""
    (a0, b0) = hs.plan.stages[0]
    dev = (b0 - a0) * hs.n
    for i, (a, b) in enumerate(hs.plan.stages[1:]):
        dev = dev + (b - a) * hs.pos_valid(i)[1].sum(axis=1)
    L = hs.cfg.num_layers
    dev = dev + L * hs.gen_count
    hs.device_kv.append(dev * hs.slot_bytes)
    hs.full_kv.append(L * (hs.n + hs.gen_count) * hs.slot_bytes)


def decode_stats(hs: SlimDecodeState, state=None) -> dict:
    """`Method.decode_stats`: swaps, moves and device-resident KV of the decode."""
    if hs.pending and state is not None:
        _after(hs, state)
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


