"""SlimInfer (Long et al., AAAI 2026, SlimInfer paper; docs/methods.md "SlimInfer"; no public
code) and
its baseline LazyLLM (Fu et al., 2024) at the same pruning layers.

SlimInfer prunes whole blocks of *hidden states* at a few "slim" layers, so deeper layers
run on fewer tokens, and while decoding it re-chooses the active blocks at every step,
keeping the KV of inactive blocks in host memory and fetching only what changed.

Defaults and where they come from (SlimInfer paper Sec. 5.1 "Implementation details" unless
said otherwise):
- blocks of 64 tokens, token units of 8 (Eq. 1 unit-mean keys), query window w = 4 (mean
  of the last 4 queries: prompt tail in prefill, the newest tokens in decode), swap
  threshold gamma = 0.9 (Algorithm 1), block 0 always active (Sec. 4.2, sinks);
- pruning layers 10, 20, 30 of 32-layer Llama keeping 8k, 4k, 2k tokens of a 32k prompt,
  scaled as docs/methods.md "Conventions" says: layers round(l * L / 32) (a layer at or past
  L - 1 starts no stage and is dropped), budgets n / 32768 of the longest prompt in whole
  blocks (rounded down) for the stages that exist, the smallest at least `min_blocks` = 3
  blocks with the earlier ones keeping the schedule's ratio to it (kvjax's floor, not the
  paper's: the sink and the up to two blocks holding the last w tokens are always active,
  so 3 always fit; at 2048 tokens it turns the paper's (8, 4, 2) blocks into (12, 6, 3);
  `min_blocks=2` runs the paper's, and refuses a prompt whose last w tokens straddle a
  block boundary, where 3 blocks are forced); explicit `layers` /
  `keep` override them; `--budget B` makes the last existing stage keep B tokens and the
  earlier ones the schedule's ratios to it (2B, 4B);
- Eq. 2 block score: max over units of the head-mean of q_l . k_rep, each query head with
  its GQA group's KV head, on post-RoPE queries and keys (what attention uses).

Readings the paper leaves open, each a parameter (default first):
- `decode_timing`: "paper" -- stage i's blocks are chosen right after pruning layer p_i
  with the query window that ends at the token being decoded (the engine splits the step
  there, `decode_segments`); "lagged" -- the candidates of step t decide step t+1;
- `decode_forced`: "sink" -- only block 0 is always active while decoding (Sec. 4.2);
  "sink_and_tail" -- the last w prompt tokens' blocks too;
- `prune_after`: "attention" -- the pruning layer's MLP runs on the kept tokens only (the
  paper prunes "right after attention"); "mlp" -- on every token, then the gather (the same
  hidden states: the MLP acts on each token alone).

Choices where the paper is silent (following ASL/FastKV where they decide):
- pruning layer p is scored from its own attention's queries and keys; the kept hidden
  states keep their original positions; layer p's KV holds every token it saw.
- at prefill the last w prompt tokens are always active (the last token's hidden state
  must reach the top of the model): the block(s) holding them are forced.
- decoding: a block pruned during prefill has no KV at deeper layers. `decode="recompute"`
  (default) revives it LazyLLM-style: its hidden state at the stage input (the aux cache,
  kept in host memory) runs the stage's layers, attending to the stage's active prompt
  blocks (by position: not to the generated tokens, which come after it), before the new
  token attends; candidates at pruning layer p_i are the blocks with keys at p_i.
  `decode="restrict"` only chooses among blocks that have KV at every layer of the stage:
  with the decode budget equal to the prefill's, those are exactly the blocks kept at
  prefill, so the active sets never change (nothing swaps; shown by the tests).
- before w tokens are decoded, the decode query window still holds the prompt's last
  queries (a ring of the last w queries at each pruning layer, continued from the prefill).
- `offload=True`: the engine decodes with its host loop of compiled steps (host <-> device
  copies cannot happen inside a `lax.while_loop`), calling `between_steps` and
  `between_segments` (`swap.py`); `offload=False` (restrict only) uses the engine's
  compiled decode loop.
- scenarios: question-aware = the question is in the prompt tail, so the w = 4 query that
  picks the blocks at prefill is the question's end. Context-only = the context is pruned
  with its own tail as query (question-blind), the question is then prefilled on top
  through the prefill's active sets (like decoded tokens, never pruned), and re-selection
  starts at the first decoded token with the question's last queries: `recompute` can
  bring back question-relevant blocks, `restrict` cannot.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.compression import budgets
from kvjax.compression.layer import LayerIO
from kvjax.compression.method import Method
from kvjax.config import ModelConfig
from kvjax.methods.registry import register
from kvjax.methods.slim import blocks, swap

SCORES = ("unit_dot", "attention")
DECODES = ("recompute", "restrict")
PRUNE_AFTER = ("attention", "mlp")
DECODE_FORCED = ("sink", "sink_and_tail")
DECODE_TIMINGS = ("paper", "lagged")


def push_chunk(ring_BWHD, q_BTHD, qvalid_BT):
    """The last w queries of ring ++ chunk, skipping padded (invalid) chunk queries."""
    w = ring_BWHD.shape[1]
    both = jnp.concatenate([ring_BWHD, q_BTHD.astype(ring_BWHD.dtype)], axis=1)
    ok = jnp.concatenate([jnp.ones(ring_BWHD.shape[:2], bool), qvalid_BT], axis=1)
    key = jnp.where(ok, jnp.arange(both.shape[1]), -1)
    idx = jnp.sort(jax.lax.top_k(key, w)[1], axis=1)
    return jnp.take_along_axis(both, idx[:, :, None, None], axis=1)


def _as_tuple(x):
    return None if x is None else tuple(int(v) for v in x)


@register
@dataclasses.dataclass(frozen=True)
class SlimInfer(Method):
    """SlimInfer: block-wise hidden-state pruning in prefill and decode with host offload
    (paper schedule scaled to the model; see the module docstring for every default)."""

    name: ClassVar[str] = "sliminfer"
    prefill_kind: ClassVar[str] = "block_pruning"
    positional: ClassVar[bool] = False
    layers_of_32: tuple[int, ...] = (10, 20, 30)
    keep_of_32k: tuple[int, ...] = (8192, 4096, 2048)
    layers: tuple[int, ...] | None = None  # absolute pruning layers (overrides layers_of_32)
    keep: tuple[int, ...] | None = None  # absolute token budgets (overrides keep_of_32k)
    keep_ratio: float | None = None  # keep this fraction of the present tokens (LazyLLM)
    budget: int | None = None  # `--budget`: tokens the last stage keeps, ratios before it
    scale_tokens: int | None = None  # the prompt length the schedule scales by (`for_prompt`)
    min_blocks: int = blocks.MIN_SCALED_BLOCKS  # the scaled schedule's floor (module docstring)
    prune_after: str = "attention"  # where the pruning layer gathers: "attention" | "mlp"
    decode_forced: str = "sink"  # blocks always active while decoding: "sink" | "sink_and_tail"
    decode_timing: str = "paper"  # "paper": chosen inside the step | "lagged": for the next
    block: int = 64
    unit: int = 8
    window: int = 4
    # gamma is read on the host only and `decode` reaches the compiled step as data, so
    # neither takes part in equality/hashing: variants share one compilation
    gamma: float = dataclasses.field(default=0.9, compare=False)
    sink_blocks: int = 1
    score: str = "unit_dot"  # Eq. 2; "attention" = LazyLLM's last-token attention
    decode: str = dataclasses.field(default="recompute", compare=False)
    offload: bool = True

    def __post_init__(self):
        super().__post_init__()
        for f in ("layers_of_32", "keep_of_32k", "layers", "keep"):
            object.__setattr__(self, f, _as_tuple(getattr(self, f)))

    # ---- schedule -----------------------------------------------------------------------

    def schedule_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        if self.layers is not None:
            return self.layers
        return blocks.scaled_layers(self.layers_of_32, cfg.num_layers)

    def stage_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The pruning layers that start a stage: the schedule's, less one at the last layer
        (no layer runs after it: on 12 layers the paper's 30 of 32 maps to 11 = L-1)."""
        return tuple(l for l in self.schedule_layers(cfg) if l < cfg.num_layers - 1)

    def plan(self, cfg: ModelConfig, T: int) -> blocks.Plan:
        """The static schedule for a padded prompt of T tokens on this model. Budgets belong
        to the stages that exist: `budget` and the scaled schedule anchor on the last of
        them, so a dropped stage never decides what the others keep."""
        layers = self.stage_layers(cfg)
        NB = -(-T // self.block)
        P = len(layers)
        if self.keep_ratio is not None:
            counts = blocks.ratio_blocks(self.keep_ratio, NB, P)
        elif self.keep is not None:
            counts = tuple(min(k // self.block, NB) for k in self.keep[:P])
        elif self.budget is not None:
            counts = blocks.budget_blocks(self.budget, self.keep_of_32k[:P], self.block, NB)
        else:
            counts = blocks.scaled_blocks(self.keep_of_32k[:P], self.scale_tokens or T,
                                          self.block, NB, self.min_blocks) if P else ()
        return blocks.Plan(cfg.num_layers, self.block, self.window, NB, layers, counts,
                           self.keep_ratio, self.prune_after)

    # ---- checks ---------------------------------------------------------------------------

    def validate(self, n: int, cfg: ModelConfig) -> None:
        bs = self.block
        if bs < 1 or self.unit < 1 or bs % self.unit:
            raise ValueError(f"unit={self.unit} must divide block={bs} (both >= 1)")
        if not 1 <= self.window <= bs:
            raise ValueError(f"window={self.window} must be in [1, block={bs}] (the last w "
                             f"tokens then span at most two blocks)")
        if n < self.window:
            raise ValueError(f"prompt length {n} is shorter than window={self.window}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma={self.gamma} outside [0, 1]")
        if self.sink_blocks < 0:
            raise ValueError(f"sink_blocks={self.sink_blocks} must be >= 0")
        for field, value, allowed in (("score", self.score, SCORES),
                                      ("decode", self.decode, DECODES)):
            if value not in allowed:
                raise ValueError(f"{field}={value!r}; allowed: {allowed}")
        if self.score == "attention" and (self.decode != "restrict" or self.offload):
            raise ValueError("score='attention' (LazyLLM) scores from full attention rows, "
                             "which offloaded blocks do not have: it needs decode='restrict', "
                             "offload=False")
        if self.decode == "recompute" and not self.offload:
            raise ValueError("decode='recompute' runs in the host-offload loop: set offload=True "
                             "(or decode='restrict')")
        layers = self.schedule_layers(cfg)
        # scaled layers at or past the last layer start no stage and are dropped (a shallow
        # model prunes fewer times); absolute ones must exist
        check = layers if self.layers is not None else self.stage_layers(cfg)
        if not self.stage_layers(cfg):
            raise ValueError(
                f"no pruning layer of {list(layers)} starts a stage on {cfg.num_layers} layers "
                f"(one must be < L - 1 = {cfg.num_layers - 1}: a layer must run after it); "
                f"allowed: set layers=... to layers in [0, {cfg.num_layers - 1})")
        if list(check) != sorted(set(check)) or not all(0 <= l < cfg.num_layers for l in check):
            raise ValueError(f"pruning layers {list(check)} must be strictly increasing in "
                             f"[0, {cfg.num_layers}) (from layers={self.layers}, layers_of_32="
                             f"{self.layers_of_32} on {cfg.num_layers} layers)")
        if self.keep_ratio is not None:
            if not 0 < self.keep_ratio <= 1:
                raise ValueError(f"keep_ratio={self.keep_ratio} outside (0, 1]")
            return
        keeps = self.keep if self.keep is not None else self.keep_of_32k
        if len(keeps) != len(layers):
            raise ValueError(f"{len(layers)} pruning layers {list(layers)} but {len(keeps)} "
                             f"budgets {list(keeps)}")
        if list(keeps) != sorted(keeps, reverse=True):
            raise ValueError(f"budgets {list(keeps)} must not increase from one pruning layer "
                             f"to the next (a stage only holds what the previous one kept)")
        for field, value, allowed in (("prune_after", self.prune_after, PRUNE_AFTER),
                                      ("decode_forced", self.decode_forced, DECODE_FORCED),
                                      ("decode_timing", self.decode_timing, DECODE_TIMINGS)):
            if value not in allowed:
                raise ValueError(f"{field}={value!r}; allowed: {allowed}")
        if self.budget is not None:
            self._validate_budget(n, cfg)
        if self.keep is not None:
            self._validate_keep(n, cfg)
        if self.budget is None and self.keep is None:
            self._validate_floor(n, cfg)

    def _validate_floor(self, n: int, cfg: ModelConfig) -> None:
        """The scaled schedule's smallest stage must hold the always-active blocks."""
        if self.min_blocks < 1:
            raise ValueError(f"min_blocks={self.min_blocks}; allowed: >= 1")
        forced = len(blocks.forced_block_ids(n, self.block, self.window, self.sink_blocks))
        P = len(self.stage_layers(cfg))
        counts = blocks.scaled_blocks(self.keep_of_32k[:P], self.scale_tokens or n, self.block,
                                      -(-n // self.block), self.min_blocks)
        if counts and min(counts) < forced:
            raise ValueError(
                f"min_blocks={self.min_blocks}: the scaled schedule keeps {list(counts)} blocks "
                f"of a {n}-token prompt, but {forced} are always active there (the sink and the "
                f"blocks holding the last window={self.window} tokens); allowed: min_blocks >= "
                f"{forced} for this prompt")

    def _validate_budget(self, n: int, cfg: ModelConfig) -> None:
        forced = len(blocks.forced_block_ids(n, self.block, self.window, self.sink_blocks))
        if not forced * self.block <= self.budget <= n:
            raise ValueError(
                f"budget={self.budget} is the last stage's kept tokens; allowed: "
                f"{forced * self.block} (the {forced} always-active blocks of {self.block}) "
                f"<= budget <= the prompt length {n}")

    def _validate_keep(self, n: int, cfg: ModelConfig) -> None:
        bs = self.block
        forced = len(blocks.forced_block_ids(n, bs, self.window, self.sink_blocks))
        for i, k in enumerate(self.keep[: len(self.stage_layers(cfg))]):
            if k % bs:
                raise ValueError(f"block={bs} does not divide keep[{i}]={k}: budgets are whole "
                                 f"blocks (allowed: multiples of {bs})")
            if k > n:
                raise ValueError(f"keep[{i}]={k} exceeds the prompt length {n}; allowed: "
                                 f"{forced * bs} <= keep <= {n}")
            if k // bs < forced:
                raise ValueError(f"keep[{i}]={k} holds {k // bs} blocks but {forced} are always "
                                 f"active (sink + the last window={self.window} tokens) for a "
                                 f"{n}-token prompt; allowed: keep >= {forced * bs}")

    def with_budget(self, budget: int) -> "SlimInfer":
        """`--budget B`: the last stage that exists on the model keeps B tokens, the earlier
        ones the schedule's ratios to it (8k:4k:2k: 2B before, 4B before that), each
        rounded to whole blocks; stage 0 keeps the whole prompt."""
        return dataclasses.replace(self, budget=budget, keep=None, keep_ratio=None)

    def for_prompt(self, n: int) -> "SlimInfer":
        """The scaled schedule's length: the longest prompt (`budgets.length_scale`)."""
        if self.keep is None and self.budget is None and self.keep_ratio is None:
            return dataclasses.replace(self, scale_tokens=budgets.length_scale(n))
        return self

    # ---- prefill hooks (the engine's `block_pruning` loop) ----------------------------------

    @property
    def needs_decode_state(self) -> bool:
        return self.offload  # (recompute requires offload: see validate)

    def kept_slots(self, n: int) -> int:
        return -(-n // self.block) * self.block

    def group_scores(self, q_tail, k_BKSD, valid_BS):
        """Group scores at a pruning layer: Eq. 2 over units, or LazyLLM's last-token
        attention (block = unit = 1, so a group is a token); and the unit keys (Eq. 1),
        which decoding scores inactive blocks with."""
        if self.score == "attention":
            return blocks.lazyllm_scores(q_tail[:, -1], k_BKSD, valid_BS), None
        rep, ok = blocks.unit_keys(k_BKSD, valid_BS, self.block, self.unit)
        return blocks.block_scores(blocks.query_mean(q_tail), rep, ok), (rep, ok)

    def choose_groups(self, i: int, plan: blocks.Plan, s_BG, blk_BG, glive_BG, n_B):
        """Pruning layer p_{i+1}: the forced blocks plus the top ones, `plan.blocks[i]` (or
        the ratio's count of the present blocks)."""
        forced = blocks.forced_mask(blk_BG, n_B, plan.block, self.window, self.sink_blocks, True)
        count = jnp.full(n_B.shape, plan.blocks[i], jnp.int32)
        if plan.ratio is not None:
            present = jnp.sum(glive_BG, axis=1, dtype=jnp.int32)
            count = jnp.ceil(plan.ratio * present).astype(jnp.int32)
        return blocks.choose(s_BG, forced, glive_BG, count, plan.blocks[i])

    def block_state(self, plan: blocks.Plan, T: int, n_B, pruned: list[dict]):
        """The decode state from what each pruning layer saw (None without offload, or on
        a model too shallow for any stage: then nothing was pruned)."""
        if not self.needs_decode_state or not pruned:
            return None
        return swap.prefill_state(plan, n_B, pruned, self.unit)

    # ---- decode hooks ---------------------------------------------------------------------

    def decode_layer(self, io: LayerIO, probs, state):
        """Keep each pruning layer's last-w query ring current (the new token's query, or a
        context-only question chunk's)."""
        if state is None:  # nothing was pruned (a model too shallow for any stage)
            return io.kv, state
        ring = state["qring"]  # [P, B, w, H, Dh]
        qvalid = io.qvalid if io.qvalid is not None else jnp.ones(io.q.shape[:2], bool)
        pushed = jax.vmap(lambda r: push_chunk(r, io.q, qvalid))(ring)
        hit = (state["players"] == io.layer)[:, None, None, None, None]
        return io.kv, {**state, "qring": jnp.where(hit, pushed, ring)}

    def uses_decode_layer(self) -> bool:
        return self.needs_decode_state

    def revival(self, layer, state):
        if not self.needs_decode_state or state is None:
            return None
        return swap.revival(layer, state, self.prune_after == "attention")

    def revived(self, layer, x_BRD, state):
        return swap.revived(layer, x_BRD, state)

    def after_layers(self, cfg: ModelConfig, cache, state, upto: int):
        if not self.needs_decode_state or state is None or "cand" not in state:
            return state
        return swap.after_layers(self, cfg, cache, state, upto)

    def steps_on_host(self) -> bool:
        return self.offload

    def decode_segments(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The paper's timing: each step splits after every pruning layer."""
        if self.decode_timing == "lagged":
            return ()
        return tuple(l + 1 for l in self.stage_layers(cfg))

    def between_segments(self, host, i, cache, state, done):
        return swap.between_segments(host, i, cache, state, done)

    def init_host(self, cfg: ModelConfig, cache, state, compile):
        if state is None:
            return None, None, 0.0
        return swap.init_host(self, cfg, cache, state, compile)

    def between_steps(self, host, cache, state, done):
        return (cache, state) if host is None else swap.between_steps(host, cache, state, done)

    def decode_stats(self, host, state) -> dict:
        return swap.decode_stats(host, state) if host is not None else {}


@register
@dataclasses.dataclass(frozen=True)
class SlimInferRestrict(SlimInfer):
    """SlimInfer whose decode only chooses blocks that have KV at the stage (no revival):
    the prefill's active sets serve every step, in the engine's compiled decode loop."""

    name: ClassVar[str] = "sliminfer_restrict"
    decode: str = dataclasses.field(default="restrict", compare=False)
    offload: bool = False


@register
@dataclasses.dataclass(frozen=True)
class SlimInferAggressive(SlimInfer):
    """A schedule more aggressive than the paper's most aggressive (8k, 4k, 2k): half of it,
    (4k, 2k, 1k) of a 32k prompt, at the same layers."""

    name: ClassVar[str] = "sliminfer_aggressive"
    keep_of_32k: tuple[int, ...] = (4096, 2048, 1024)


@register
@dataclasses.dataclass(frozen=True)
class LazyLLM(SlimInfer):
    """LazyLLM (Fu et al., 2024) as SlimInfer's baseline (SlimInfer paper Sec. 5.1: "pruning at
    the same layers as SlimInfer, retaining 50% of tokens at each pruning layer").

    Token-level (block = unit = 1): at each pruning layer the last token's softmax attention
    averaged over all heads scores the tokens present, and 50% of them are kept (ceil), so
    pruning is progressive (1/2, 1/4, 1/8 of the prompt: LazyLLM prunes along depth, each
    layer among the tokens the previous one kept). The last token is always kept; no sink
    is forced. Decoding uses the prefill's kept tokens (decode='restrict'): LazyLLM's own
    decode re-prunes with full attention rows and revives via its aux cache, which is not
    implemented here."""

    name: ClassVar[str] = "lazyllm"
    keep_ratio: float | None = 0.5
    block: int = 1
    unit: int = 1
    window: int = 1
    gamma: float = dataclasses.field(default=1.0, compare=False)
    sink_blocks: int = 0
    score: str = "attention"
    decode: str = dataclasses.field(default="restrict", compare=False)
    offload: bool = False

