"""CaM (Zhang et al., ICML 2024, "CaM: cache merging for memory-efficient LLMs inference";
the authors' code is zyxxmu/cam). A baseline of D2O's tables (D2O paper Sec. 2 "Token
Merging": "CaM proposes to use a Bernoulli process to generate a mask for value state
merging on the KV cache"; Tables 1-3, 15-17, 19, 20; docs/methods.md "D2O": "CaM (merging
with a Bernoulli mask)"). The CaM paper's own text is not among the shared papers: the formulas
below are the authors' code's, and no equation numbers are cited for that reason.

Eviction (the authors' `LlamaAttention_cam`, `cam_hf/utils_hh/modify_llama_cam.py`): a
start + recent cache, StreamingLLM-style -- the first `start` entries and the most recent
`budget - start` are kept; at prefill the middle of the prompt is dropped (no merge there:
the code merges only while decoding), and at every decoding step the oldest entry of the
recent window leaves once the budget is full, so exactly `budget` stay live.

Merge (`local_cam_mask` there; `kv_cache_cam.slicev` in its streaming variant): the value
of the evicted entry i is merged into the values of the next m = `merge_budget` kept
entries by position (the m oldest of the recent window), with a Bernoulli mask:
    p_i = a_i / mean_{j in targets} a_j,     M_i ~ Bernoulli(clip(p_i, 0, 1))
    v_j <- v_j + M_i * v_i / m              for the m targets j
where a is this step's attention of the new token (averaged over the G query heads of the
KV head; the code is per head of MHA models). Keys, positions and validity of the targets
do not change. So when the next query attends like this one, the targets return in
expectation min(a_i, mean a_targets) * v_i -- the output term a_i * v_i that eviction
loses (CaM's "output perturbation"), which is why the mask is Bernoulli in a_i / mean.

Choices, where the two code paths differ or say nothing:
- the mean in p_i runs over the m targets (`slicev`; `local_cam_mask` takes it over the
  whole recent window, about the same set when the window holds about m entries);
- m = number of targets actually present (the code divides by merge_budget = 32 even when
  the slice it adds to is shorter): the merged mass sum_j dv_j = M_i v_i always;
- NaN p (0 / 0) is 0 and a_i / 0 is 1, as the code's `isnan`/clamp handling yields;
- one Bernoulli draw per (element, KV head, evicted entry), from a PRNG key carried in
  the method state (`seed`), folded with the layer and that layer's step counter, so a
  run is reproducible and no draw is reused;
- a context-only question chunk of T tokens evicts up to T entries, merged together
  from the pre-merge values (the attention summed over the chunk's queries).

Defaults: start_ratio = 0.5 -- the README runs `--start_ratio r --recent_ratio r` (0.1 and
0.2 of the prompt) and the long-PPL run `--start_size 32 --recent_size 32`: start = recent,
half of the budget each; merge_budget = 32 (`local_cam_mask`); seed = 0 (a choice).
`merge=False` is the start + recent cache alone (StreamingLLM with start sinks).
Method state: key, per-layer step counters [L], merges / discards [L, B].
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.compression import scoring, selection
from kvjax.compression.eviction import DecodeEviction, force, query_sum
from kvjax.compression.layer import LayerIO, LayerKV, Rows
from kvjax.config import ModelConfig
from kvjax.methods.registry import register


def cam_merge(
    v_BKCD: Float[Array, "B K C D"],
    pos_BKC: Int[Array, "B K C"],
    kept_BKC: Bool[Array, "B K C"],
    gone_BKC: Bool[Array, "B K C"],
    attn_BKC: Float[Array, "B K C"],
    start: int,
    merge_budget: int,
    key: Array,
    max_evict: int,
) -> tuple[Rows, Bool[Array, "B K C"], Float[Array, "B K C"]]:
    """CaM's Bernoulli value merge (zyxxmu/cam `local_cam_mask`; see the module docstring).

    Every gone entry i (at most `max_evict` per head, static) merges into its targets --
    the `merge_budget` kept entries at positions > pos_i, pos >= start, lowest positions
    first -- with probability clip(a_i / mean_targets a, 0, 1): v_j += v_i / #targets.
    Returns (v's changed rows as `Rows` (`extend` scatters them into the cache; `.into(v)`
    is the dense v), merged [B,K,C] (which gone entries merged), p [B,K,C] (the merge
    probability of every gone entry, 0 elsewhere)).
    """
    B, K, C, D = v_BKCD.shape
    E = min(max_evict, C)
    m = min(merge_budget, C)
    # the gone entries, oldest first
    _, gi = jax.lax.top_k(jnp.where(gone_BKC, -pos_BKC.astype(jnp.float32), -jnp.inf), E)
    hit = jnp.take_along_axis(gone_BKC, gi, axis=-1)  # [B, K, E]
    pos_e = jnp.take_along_axis(pos_BKC, gi, axis=-1)
    cand = (kept_BKC & (pos_BKC >= start))[:, :, None, :] & (
        pos_BKC[:, :, None, :] > pos_e[..., None])  # [B, K, E, C]
    _, ti = jax.lax.top_k(jnp.where(cand, -pos_BKC[:, :, None, :].astype(jnp.float32),
                                    -jnp.inf), m)  # [B, K, E, m]
    tok = jnp.take_along_axis(cand, ti, axis=-1)
    nt = jnp.sum(tok, axis=-1)  # [B, K, E]
    a = attn_BKC.astype(jnp.float32)
    a_e = jnp.take_along_axis(a, gi, axis=-1)
    a_t = jnp.take_along_axis(jnp.broadcast_to(a[:, :, None, :], cand.shape), ti, axis=-1)
    abar = jnp.sum(jnp.where(tok, a_t, 0.0), axis=-1) / jnp.maximum(nt, 1)
    p = jnp.where(abar > 0, a_e / jnp.where(abar > 0, abar, 1.0), (a_e > 0).astype(jnp.float32))
    p = jnp.where(hit & (nt > 0), jnp.clip(p, 0.0, 1.0), 0.0)
    mask = hit & (nt > 0) & (jax.random.uniform(key, p.shape) < p)  # [B, K, E]
    v_e = jnp.take_along_axis(v_BKCD, gi[..., None], axis=2).astype(jnp.float32)  # [B,K,E,D]
    w = jnp.where(tok & mask[..., None], 1.0 / jnp.maximum(nt, 1)[..., None], 0.0)  # [B,K,E,m]
    # the E*m targets as Rows: each gets every (source, target) term aimed at its slot, so
    # two gone entries sharing a target write the same sum (no scatter-add collisions)
    t_F, tok_F, w_F = (x.reshape(B, K, E * m) for x in (ti, tok, w))
    same = t_F[..., :, None] == t_F[..., None, :]  # [B, K, F, F]
    src = jnp.broadcast_to(v_e[:, :, :, None, :], (B, K, E, m, D)).reshape(B, K, E * m, D)
    old = jnp.take_along_axis(v_BKCD, t_F[..., None], axis=2).astype(jnp.float32)
    new = old + jnp.einsum("bkfg,bkgd->bkfd", jnp.where(same, w_F[..., None, :], 0.0), src)
    v = Rows(jnp.where(tok_F, t_F, C), new.astype(v_BKCD.dtype))
    # top_k indices are distinct within a head, so `set` never collides
    scatter = lambda x: selection.mark(gone_BKC.shape, gi, jnp.where(hit, x, jnp.zeros_like(x)))  # noqa: E731
    return v, scatter(mask), scatter(p)


@register
@dataclasses.dataclass(frozen=True)
class CaM(DecodeEviction):
    """CaM: a start + recent cache whose evicted values merge, with a Bernoulli mask, into
    the next `merge_budget` kept values at every decoding step."""

    name: ClassVar[str] = "cam"
    forced_what: ClassVar[str] = "the start tokens"
    budget: int = 128
    start_ratio: float = 0.5
    merge_budget: int = 32
    seed: int = 0
    merge: bool = True

    @property
    def start(self) -> int:
        """Entries at the start of the sequence that are never evicted."""
        return int(self.budget * self.start_ratio)

    @property
    def forced(self) -> int:
        return self.start

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if not 0 <= self.start_ratio < 1:
            raise ValueError(f"start_ratio={self.start_ratio} outside [0, 1)")
        if self.merge_budget < 1:
            raise ValueError(f"merge_budget={self.merge_budget} must be >= 1")
        super().validate(n, cfg)

    # ---- prefill: start + most recent (no merge, as the code) ----------------------------

    def scores(self, io: LayerIO) -> Float[Array, "B K T"]:
        """Prefill: the position (most recent highest), the first `start` forced."""
        valid = io.valid[:, 0]
        s = jnp.broadcast_to(io.pos[:, 0].astype(jnp.float32)[:, None], io.valid.shape)
        return force(s, valid & (io.pos[:, 0] < self.start), valid)

    def finalize(self, kv, aux, state):
        """-> (cache, decode state {key (PRNGKey(seed)), step [L], merges [L, B],
        discards [L, B]}, stats)."""
        kv, _, stats = super().finalize(kv, None, None)
        L, B = kv.pos.shape[:2]
        z = jnp.zeros((L, B), jnp.int32)
        state = {"key": jax.random.PRNGKey(self.seed), "step": jnp.zeros((L,), jnp.int32),
                 "merges": z, "discards": z}
        return kv, state, stats

    # ---- decode -------------------------------------------------------------------------

    def decode_scores(self, io: LayerIO, probs_BKGTC: Float[Array, "B K G T C"], st):
        """The oldest entry outside the start goes (StreamingLLM's rolling cache)."""
        return io.pos.astype(jnp.float32), io.pos >= self.start, st

    def decode_layer(self, io: LayerIO, probs_BKGTC: Float[Array, "B K G T C"], st):
        """Decode hook (inside the jitted loop): `DecodeEviction`'s eviction, then the
        Bernoulli value merge of the evicted entries (`cam_merge`: the changed value rows,
        no Python branch on data); counts merges and discards."""
        evicted, st = super().decode_layer(io, probs_BKGTC, st)
        k, v, pos, kept = evicted.k, evicted.v, evicted.pos, evicted.valid
        gone = io.valid & ~kept
        l = io.layer
        take, put = io.at_layer, io.set_layer
        step = take(st["step"])
        if self.merge:
            attn = scoring.gqa_reduce(query_sum(probs_BKGTC, io.qvalid), "mean")  # [B, K, C]
            key = jax.random.fold_in(jax.random.fold_in(st["key"], l), step)
            v, merged, _ = cam_merge(v, pos, kept, gone, attn, self.start, self.merge_budget,
                                     key, io.q.shape[1])
        else:
            merged = jnp.zeros_like(gone)
        nm = jnp.sum(merged, axis=(-1, -2), dtype=jnp.int32)
        nd = jnp.sum(gone, axis=(-1, -2), dtype=jnp.int32) - nm
        st = {**st, "step": put(st["step"], step + 1),
              "merges": put(st["merges"], take(st["merges"]) + nm),
              "discards": put(st["discards"], take(st["discards"]) + nd)}
        return LayerKV(k, v, pos, kept), st
