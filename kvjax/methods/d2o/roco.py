"""RoCo (Ren & Zhu 2024, "On the efficacy of eviction policy for key-value constrained
generative language model inference", arXiv 2402.06262; the authors' code is EasyKV,
DRSY/EasyKV `easykv/easykv.py`, policy `roco`). A baseline of D2O's tables (D2O paper
Sec. 1: "mean attention scores (e.g., RoCo)"; Tables 1, 2 and 17; docs/methods.md "D2O":
"RoCo (mean attention + std)"). The RoCo paper's own text is not among the shared papers:
the formulas below are EasyKV's, and no equation numbers are cited for that reason.

Per cached entry j (per KV head; attention averaged over the G query heads first, as
EasyKV's `process_for_mqa_gqa`) over every query t that saw it:
    s_j = sum_t a_tj,   s2_j = sum_t a_tj^2,   c_j = #queries that saw j
    mean_j = s_j / c_j             (the paper's temporal attention score: H2O's
                                    accumulated attention divided by the count)
    std_j  = sqrt(s2_j / c_j - mean_j^2)   (its robustness measure)
Prompt entry i of an n-token prompt is seen by c = n - i queries; every decoding step adds
one query to every live entry (a new entry starts at c = 1).

Eviction scope (EasyKV, `mode in ['roco']`): the first `sinks` entries and the `recent`
newest are never evicted (std set to 1e9 on `[:sink_length]` and `[-10:]`), the scope is
the k = budget - int(budget * recent_ratio) - sinks lowest-std entries, and the entry
evicted is the lowest mean inside the scope. When the cache holds budget + 1 entries (one
decoding step) this is the same as protecting the
    P = max(0, int(budget * recent_ratio) - recent + 1)
highest-std entries of the rest and evicting the lowest mean of what remains; kvjax uses
that form everywhere (`std_protected`), so one rule serves the prefill (one-shot: keep
the sinks, the newest, the P highest std, then the top means up to `budget`) and every
decoding step (once the budget is full: evict the lowest mean outside those, so exactly
`budget` stay live). EasyKV encodes the prompt in strides and evicts as it goes; kvjax
selects once after the prompt (as H2O here). With a context-only question chunk of T
tokens the T lowest means go (EasyKV: `topk(..., k=stride)` over the scope).

Defaults (EasyKV): sinks = 4 (`temp_length`
default 4), recent = 10 (the hard-coded `cur_std[:, :, -10:] = 1e9`), recent_ratio = 0.1
(`generate()`'s default `recent_ratio`, used by its prompt-encoding modes -- the setting of
D2O's tables, which compress prompts; the decoding-only mode hard-codes 0.3). Below
budget 100 that gives P = 0 (128 gives 3, 1024 gives 93): RoCo is then "lowest mean
attention, sinks and the 10 newest kept".

Counts ignore a sliding window (none of the Llama/Qwen configs here has one in reach).
Method state: s, s2, c per slot [L, B, K, C].
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.compression import scoring, selection
from kvjax.compression.eviction import DecodeEviction
from kvjax.compression.layer import LayerIO
from kvjax.config import ModelConfig
from kvjax.methods.registry import register
from kvjax.models import attention


def attention_moments(
    q_BTHD: Float[Array, "B T H D"],
    k_BKSD: Float[Array, "B K S D"],
    qpos_BT: Int[Array, "B T"],
    qvalid_BT: Bool[Array, "B T"],
    kpos_BKS: Int[Array, "B K S"],
    kvalid_BKS: Bool[Array, "B K S"],
    block: int = 256,
    lse_BKGT: Float[Array, "B K G S"] | None = None,
) -> tuple[Float[Array, "B K S"], Float[Array, "B K S"], Float[Array, "B K S"]]:
    """RoCo's moments of the causal attention every key receives (arXiv 2402.06262; EasyKV
    `h2o_head_score` with squares): (sum_t a_tj, sum_t a_tj^2, count of queries t that see j)
    with a = the softmax averaged over the G query heads of the KV head, over the valid
    queries. Queries run in blocks of `block` (at most [B, H, block, S] at a time);
    `lse_BKGT` as in `scoring.fold_query_blocks`."""
    B, K, S = kvalid_BKS.shape

    def step(carry, probs, ok, v):
        a = jnp.mean(probs, axis=2)  # [B, K, b, S]
        w = v[:, None, :, None]
        s, s2, c = carry
        return (s + jnp.sum(jnp.where(w, a, 0.0), axis=2),
                s2 + jnp.sum(jnp.where(w, a * a, 0.0), axis=2),
                c + jnp.sum(ok & w, axis=2, dtype=jnp.float32))

    z = jnp.zeros((B, K, S), jnp.float32)
    return scoring.fold_query_blocks(step, (z, z, z), q_BTHD, k_BKSD, qpos_BT, qvalid_BT,
                                     kpos_BKS, kvalid_BKS, block, lse_BKGT)


def mean_std(s_BKC: Float[Array, "B K C"], s2_BKC: Float[Array, "B K C"],
             c_BKC: Float[Array, "B K C"]) -> tuple[Float[Array, "B K C"], Float[Array, "B K C"]]:
    """RoCo's temporal mean s / c and standard deviation sqrt(s2 / c - mean^2) (0 where c = 0)."""
    c = jnp.maximum(c_BKC, 1.0)
    mean = s_BKC / c
    return mean, jnp.sqrt(jnp.maximum(s2_BKC / c - mean * mean, 0.0))


@register
@dataclasses.dataclass(frozen=True)
class RoCo(DecodeEviction):
    """RoCo: evict the lowest mean attention outside the sinks, the `recent` newest and
    the `std_protected` highest-std entries; at prefill and every decoding step."""

    name: ClassVar[str] = "roco"
    forced_what: ClassVar[str] = "the sinks, the newest entries and the highest-std entries"
    budget: int = 128
    sinks: int = 4
    recent: int = 10
    recent_ratio: float = 0.1
    block: int = 256

    @property
    def std_protected(self) -> int:
        """P = int(budget * recent_ratio) - recent + 1 (EasyKV's scope at budget + 1)."""
        return max(0, int(self.budget * self.recent_ratio) - self.recent + 1)

    @property
    def forced(self) -> int:
        return self.sinks + self.recent + self.std_protected

    def validate(self, n: int, cfg: ModelConfig) -> None:
        if self.sinks < 0 or self.recent < 1:
            raise ValueError(f"sinks={self.sinks} must be >= 0 and recent={self.recent} >= 1")
        if not 0 <= self.recent_ratio < 1:
            raise ValueError(f"recent_ratio={self.recent_ratio} outside [0, 1)")
        super().validate(n, cfg)

    def protected(self, pos_BKC: Int[Array, "B K C"], valid_BKC: Bool[Array, "B K C"],
                  std_BKC: Float[Array, "B K C"]) -> Bool[Array, "B K C"]:
        """Never evicted: sinks (pos < sinks), the `recent` newest positions, and the
        `std_protected` highest-std live entries among the rest (ties: lower slot)."""
        top = jnp.max(jnp.where(valid_BKC, pos_BKC, -1), axis=-1, keepdims=True)
        base = valid_BKC & ((pos_BKC < self.sinks) | (pos_BKC > top - self.recent))
        P = min(self.std_protected, pos_BKC.shape[-1])
        if P == 0:
            return base
        cand = valid_BKC & ~base
        _, idx = jax.lax.top_k(jnp.where(cand, std_BKC, -jnp.inf), P)
        return base | selection.mark(pos_BKC.shape, idx, jnp.take_along_axis(cand, idx, axis=-1))

    # ---- prefill ------------------------------------------------------------------------

    def after_layer_prefill(self, io: LayerIO, state):
        """Prefill hook: the moments of every prompt entry (`attention_moments`), then keep
        the protected entries and the top means up to `budget` (EasyKV's eviction scope
        applied once to the whole prompt); the kept entries' moments go to `finalize`."""
        T = io.k.shape[2]
        s, s2, c = attention_moments(io.q, io.k, io.qpos, io.valid[:, 0], io.pos, io.valid,
                                     self.block, io.lse)
        mean, std = mean_std(s, s2, c)
        sc = jnp.where(self.protected(io.pos, io.valid, std), jnp.inf,
                       jnp.where(io.valid, mean, -jnp.inf))
        idx, live = self.choose(io, sc, self.head_budgets(io, sc, state),
                                self.cache_slots(T, io.cfg))
        kv = selection.gather_kept(io.kv, idx, live, io.kernels.compact)
        take = lambda x: jnp.where(kv.valid, jnp.take_along_axis(x, idx, axis=-1), 0.0)  # noqa: E731
        return kv, {"s": take(s), "s2": take(s2), "c": take(c)}, state

    def finalize(self, kv, moments, state):
        """-> (cache, decode state {s, s2, c} [L, B, K, S], stats)."""
        kv, _, stats = super().finalize(kv, None, None)
        return kv, moments, stats  # per slot [L, B, K, S]

    def pad_state(self, st, capacity: int):
        """The per-slot moments padded with zeros to the decoding cache's capacity."""
        pad = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, capacity - a.shape[-1])])  # noqa: E731
        return {k: pad(a) for k, a in st.items()}

    # ---- decode (DecodeEviction.decode_layer: evict the lowest mean that may go) --------

    def decode_scores(self, io: LayerIO, probs_BKGTC: Float[Array, "B K G T C"], st):
        """Decode hook (inside the jitted loop, via `DecodeEviction.decode_layer`): add
        this step's attention to the moments, -> (mean [B,K,C], evictable = not protected
        [B,K,C], state); the lowest mean evictable entries go while live > budget."""
        a = jnp.mean(probs_BKGTC, axis=2)  # [B, K, T, C]: GQA mean per query
        qv = jnp.ones(io.qpos.shape, bool) if io.qvalid is None else io.qvalid
        w = qv[:, None, :, None]
        seen = attention.mask(io.qpos, io.pos, io.valid) & w  # [B, K, T, C]
        take = io.at_layer
        new = {"s": take(st["s"]) + jnp.sum(jnp.where(w, a, 0.0), axis=2),
               "s2": take(st["s2"]) + jnp.sum(jnp.where(w, a * a, 0.0), axis=2),
               "c": take(st["c"]) + jnp.sum(seen, axis=2, dtype=jnp.float32)}
        st = {k: io.set_layer(st[k], x) for k, x in new.items()}
        mean, std = mean_std(new["s"], new["s2"], new["c"])
        return mean, ~self.protected(io.pos, io.valid, std), st

    def on_evict(self, gone_BKC: Bool[Array, "B K C"], io: LayerIO, st):
        """Evicted slots start from zero moments (the next token written there)."""
        return {k: io.set_layer(a, jnp.where(gone_BKC, 0.0, io.at_layer(a)))
                for k, a in st.items()}
