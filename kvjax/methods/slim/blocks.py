"""SlimInfer's schedule and block scores (SlimInfer paper Sec. 4.1-4.2, Eq. 1-2), shared by the
prefill, the decode step and the LazyLLM baseline.

Layout. The prompt is cut into blocks of `block` tokens by *original position* (block j =
positions [j*block, (j+1)*block)), each block into units of `unit` tokens. Every token set
the model runs on is stored as whole blocks ("groups" of `block` slots), groups ascending
by block id, so a slot's block is `slot // block` of its group and a partial last block has
dead slots. Stage 0 (the preserve layers) holds every block; stage i >= 1 holds the blocks
kept at pruning layer p_i.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.compression import scoring, selection
from kvjax.config import ModelConfig

# Llama-3.1-8B has 32 layers and the paper's schedule is given for 32k prompts (Sec. 5.1)
PAPER_LAYERS = 32
PAPER_CONTEXT = 32768
# scaled budgets never drop below sink + the (at most two) blocks holding the last w tokens:
# kvjax's floor, not the paper's (SlimInfer.min_blocks)
MIN_SCALED_BLOCKS = 3


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of one run: a schedule resolved for a model depth and a padded
    prompt length T. Hashable: it fixes the compiled shapes (one compilation per plan)."""

    num_layers: int
    block: int
    window: int  # w: the queries that score the blocks (the last w tokens)
    num_blocks: int  # NB: blocks covering T
    layers: tuple[int, ...]  # pruning layers p_1 < ... < p_P whose following stage is not empty
    blocks: tuple[int, ...]  # static groups (blocks) held by stages 1..P
    ratio: float | None = None  # keep a fraction of the present tokens instead (LazyLLM)
    prune_after: str = "attention"  # the pruning layer's MLP runs on the kept tokens only

    @property
    def slots(self) -> int:
        """T' = NB * block: the stage-0 token slots."""
        return self.num_blocks * self.block

    @property
    def stages(self) -> tuple[tuple[int, int], ...]:
        """Half-open layer ranges of stages 0..P: stage i runs layers p_i+1 .. p_{i+1}."""
        bounds = (-1, *self.layers, self.num_layers - 1)
        return tuple((a + 1, b + 1) for a, b in zip(bounds[:-1], bounds[1:]))


def scaled_layers(layers_of_32, num_layers: int) -> tuple[int, ...]:
    """Llama-indexed layers scale with depth as round(l * L / 32) (docs/methods.md, "Conventions")."""
    return tuple(int(round(l * num_layers / PAPER_LAYERS)) for l in layers_of_32)


def scaled_blocks(keep_of_32k, n: int, block: int, num_blocks: int,
                  floor: int = MIN_SCALED_BLOCKS) -> tuple[int, ...]:
    """Token budgets given for 32k prompts, scaled by n / 32768, in whole blocks (rounded
    down), at most every block of the prompt. The smallest stage keeps at least `floor`
    blocks (by default MIN_SCALED_BLOCKS: the forced blocks always fit); when that floor
    binds, the earlier stages keep the schedule's ratios to it (the paper's 2:1 between
    stages), not the floor as well."""
    scaled = [int(k * n / PAPER_CONTEXT) // block for k in keep_of_32k]
    last = max(scaled[-1], floor)
    return tuple(min(max(b, math.ceil(last * k / keep_of_32k[-1])), num_blocks)
                 for b, k in zip(scaled, keep_of_32k))


def budget_blocks(budget: int, keep_of_32k, block: int, num_blocks: int) -> tuple[int, ...]:
    """`--budget B`: the last stage keeps B tokens, the earlier ones the schedule's ratios
    to it (4:2:1 for 8k:4k:2k), each rounded to whole blocks (at least one)."""
    return tuple(min(max(1, round(budget * k / keep_of_32k[-1] / block)), num_blocks)
                 for k in keep_of_32k)


def ratio_blocks(ratio: float, num_blocks: int, stages: int) -> tuple[int, ...]:
    """Static upper bounds when each stage keeps ceil(ratio * present) blocks."""
    out, nb = [], num_blocks
    for _ in range(stages):
        nb = max(1, math.ceil(ratio * nb))
        out.append(nb)
    return tuple(out)


def forced_block_ids(n: int, block: int, window: int, sink_blocks: int) -> set[int]:
    """Blocks that are always active for an n-token prompt: the sink blocks and the blocks
    holding the last `window` tokens (two when the window straddles a block boundary)."""
    return {b for b in range(min(sink_blocks, -(-n // block)))} | {
        (n - window) // block, (n - 1) // block}


# ---- scores -------------------------------------------------------------------------------


def query_mean(q_BWHD: Float[Array, "B W H D"], valid_BW: Bool[Array, "B W"] | None = None
               ) -> Float[Array, "B H D"]:
    """q_l: the mean of the last w queries (Sec. 4.2), float32."""
    q = q_BWHD.astype(jnp.float32)
    if valid_BW is None:
        return jnp.mean(q, axis=1)
    w = valid_BW[:, :, None, None].astype(jnp.float32)
    return jnp.sum(q * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)


def unit_keys(
    k_BKSD: Float[Array, "B K S D"], valid_BS: Bool[Array, "B S"], block: int, unit: int
) -> tuple[Float[Array, "B K G M D"], Bool[Array, "B G M"]]:
    """Eq. 1: k_rep(j, m) = the mean of the live keys of unit m of group j (float32), and
    which units hold at least one live key (a partial last block has empty units)."""
    B, K, S, D = k_BKSD.shape
    G, M = S // block, block // unit
    k = k_BKSD.astype(jnp.float32).reshape(B, K, G, M, unit, D)
    w = valid_BS.reshape(B, 1, G, M, unit, 1).astype(jnp.float32)
    count = jnp.sum(w, axis=4)  # [B, 1, G, M, 1]
    rep = jnp.sum(k * w, axis=4) / jnp.maximum(count, 1.0)
    return rep, count[:, 0, :, :, 0] > 0


def block_scores(
    q_BHD: Float[Array, "B H D"], rep_BKGMD: Float[Array, "B K G M D"], ok_BGM: Bool[Array, "B G M"]
) -> Float[Array, "B G"]:
    """Eq. 2: r(q_l, B_j) = max_m (1/H) sum_h q_l^h . k_rep^h(j, m), each query head with the
    KV head its group shares; groups without a live unit score -inf."""
    B, H, D = q_BHD.shape
    K = rep_BKGMD.shape[1]
    q = q_BHD.reshape(B, K, H // K, D)
    dots = jnp.einsum("bkhd,bkgmd->bgm", q, rep_BKGMD, preferred_element_type=jnp.float32) / H
    return jnp.max(jnp.where(ok_BGM, dots, -jnp.inf), axis=-1)


def lazyllm_scores(q_BHD: Float[Array, "B H D"], k_BKSD: Float[Array, "B K S D"],
                   valid_BS: Bool[Array, "B S"]) -> Float[Array, "B S"]:
    """LazyLLM's token importance: the last token's softmax attention (fp32, 1/sqrt(d)) to
    every live key, averaged over all query heads."""
    return jnp.mean(scoring.last_token_attention(q_BHD[:, None], k_BKSD, valid_BS), axis=(1, 2))


# ---- selection ----------------------------------------------------------------------------


def forced_mask(blk_BG: Int[Array, "B G"], n_B: Int[Array, "B"], block: int, window: int,
                sink_blocks: int, tail: bool = True) -> Bool[Array, "B G"]:
    """Groups whose block must stay active: the sinks, and (`tail`) the blocks of the last w
    prompt tokens."""
    forced = blk_BG < sink_blocks
    if tail:
        n = n_B[:, None]
        forced |= (blk_BG == (n - 1) // block) | (blk_BG == (n - window) // block)
    return forced


def choose(
    s_BG: Float[Array, "B G"], forced_BG: Bool[Array, "B G"], live_BG: Bool[Array, "B G"],
    count_B: Int[Array, "B"], S: int,
) -> tuple[Int[Array, "B S"], Bool[Array, "B S"]]:
    """The forced groups plus the top-scoring others, `count` in all (<= S static): group
    indices ascending, and which of the S picks are live. Ties: lower index first."""
    s = jnp.where(live_BG, jnp.where(forced_BG, jnp.inf, s_BG), -jnp.inf)
    idx, live = selection.slots_from_scores(s[:, None], count_B[:, None], S)
    idx, live = idx[:, 0], live[:, 0]
    return idx, live & jnp.take_along_axis(live_BG, idx, axis=1)






# ---- FLOP accounting ---------------------------------------------------------------------


def layer_flops(cfg: ModelConfig, tokens: int, keys_mean: float,
                mlp_tokens: int | None = None) -> float:
    """FLOPs of one layer: projections for `tokens` queries each seeing `keys_mean` keys on
    average (2 per multiply-add; q.k and p.v included), and the SwiGLU MLP on `mlp_tokens`
    (default: the same tokens)."""
    D, H, K, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F = cfg.intermediate_size
    mlp_tokens = tokens if mlp_tokens is None else mlp_tokens
    attn = 2 * tokens * (D * (H + 2 * K) * Dh + H * Dh * D) + 4 * tokens * keys_mean * H * Dh
    return attn + 2 * mlp_tokens * 3 * D * F


def prefill_flop_ratio(cfg: ModelConfig, layer_tokens: list[int], n: int,
                       mlp_tokens: list[int] | None = None) -> float:
    """Computed prefill FLOPs with per-layer token counts vs the full prompt at every layer
    (causal attention: a token sees (t + 1) / 2 keys on average; scoring/gather excluded).
    `layer_tokens`: the tokens each layer attends with (live tokens, or the padded slots a
    fixed-shape stage actually runs); `mlp_tokens`: those its MLP runs on (default: the
    same; pruning right after a layer's attention runs its MLP on the kept ones)."""
    mlp = mlp_tokens or layer_tokens
    pruned = sum(layer_flops(cfg, t, (t + 1) / 2, m) for t, m in zip(layer_tokens, mlp))
    return pruned / (cfg.num_layers * layer_flops(cfg, n, (n + 1) / 2))
