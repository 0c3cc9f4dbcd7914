"""HeadKV (Fu et al., ICLR 2025, "Not all heads matter: a head-level KV cache compression
method with integrated retrieval and reasoning", arXiv 2410.19258): offline head scores and
the per-head budgets they give. The method is `kvjax.methods.baselines.headkv`; the scores come from
`python -m kvjax.headkv_scores` and live in `kvjax/assets/head_scores/<model>.json`.

Head scores (paper Sec. 3.1, "head-level importance score estimation"; authors' code
`retrieval_head_detection_r2.py::retrieval_calculate`). Needle-in-a-haystack prompts; while
the answer is written, answer step t's query of head h attends `a_t` over every key it sees:
- `reason` (HeadKV-R2, the retrieval-reasoning score, the authors' default
  `head_choice='reason'`): with k = the needle's length and A the answer's length,
  `s_h += 10 / (k * A) * sum_{i in top_k(a_t), i in needle} a_t[i]` -- attention mass on the
  needle among the head's k most attended keys.
- `copy` (retrieval score of Wu et al. 2025, HeadKV's `head_choice='copy'`):
  `s_h += 1 / A` when `argmax a_t` lies in the needle and holds the token being written.
Per head, the mean over samples (the authors' `np.mean` over each head's list).

Budgets (paper Sec. 3.2, "head-level KV cache allocation"; code
`headkv/snapkv_utils.py::ReasonSnapKVCluster`): a shared pool taken from every head,
redistributed by normalised score, on top of a uniform floor. With `B` = budget per head
(window included, kvjax's convention), `w` the window and `base = B - w` (the code's
`base_capacity = max_capacity_prompt - window_size`):

    p = s / sum s;  p = p**temp / sum p**temp                     (temp = 1 in the paper)
    pool = (base // beta) * L * H;  floor = base - base // beta
    b_{l,h} = round(p_{l,h} * pool + floor) + w                   (torch.round: half to even)

so the total is `L * H * B` up to rounding. GQA: the authors' cache is per query head; kvjax
keeps one entry set per KV head (docs/methods.md "Conventions"), so a KV head's share is the sum of
its G query heads' shares over a pool of `(base // beta) * L * K` (= the mean of the query
heads' budgets in the authors' formula).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from jaxtyping import Bool, Float, Int

from kvjax.config import ModelConfig

SCORES_DIR = Path(__file__).resolve().parents[2] / "assets" / "head_scores"
SCORE_KINDS = ("reason", "copy")
SCRIPT = "python -m kvjax.headkv_scores --model <bundled name or checkpoint dir>"


# ---- offline scores ------------------------------------------------------------------

def reason_score(p_LHAT: Float[np.ndarray, "L H A T"], needle_T: Bool[np.ndarray, "T"]
                 ) -> Float[np.ndarray, "L H"]:
    """HeadKV-R2 score of one sample: sum over answer steps of the attention on needle keys
    among each head's top-k keys (k = needle length), times 10 / (k * A)."""
    k = int(needle_T.sum())
    A = p_LHAT.shape[2]
    top = np.argsort(-p_LHAT, axis=-1, kind="stable")[..., :k]  # ties: lower index first
    a = np.take_along_axis(p_LHAT, top, axis=-1) * needle_T[top]
    return 10.0 * a.sum(axis=(2, 3)) / (k * A)


def copy_score(p_LHAT: Float[np.ndarray, "L H A T"], needle_T: Bool[np.ndarray, "T"],
               ids_T: Int[np.ndarray, "T"], answer_A: Int[np.ndarray, "A"]
               ) -> Float[np.ndarray, "L H"]:
    """Retrieval score of one sample (Wu et al.): the fraction of answer steps whose most
    attended key lies in the needle and holds the token being written."""
    top = np.argmax(p_LHAT, axis=-1)  # [L, H, A], lower index on ties
    hit = needle_T[top] & (ids_T[top] == answer_A[None, None, :])
    return hit.mean(axis=-1)


# ---- loading ------------------------------------------------------------------------

def describe(cfg: ModelConfig) -> str:
    return (f"{cfg.family}, {cfg.num_layers} layers x {cfg.num_heads} query / "
            f"{cfg.num_kv_heads} KV heads, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")


def _matches(data: dict, cfg: ModelConfig) -> bool:
    try:
        return ModelConfig.from_hf(data["config"]) == cfg
    except (KeyError, ValueError, TypeError):
        return False


@functools.lru_cache(maxsize=32)
def load_scores(spec: str | None, cfg: ModelConfig) -> np.ndarray:
    """[L, H] head scores (query heads) of the model `cfg` describes.

    `spec`: a file path, a model name (`kvjax/assets/head_scores/<name>.json`), or None:
    the file under `kvjax/assets/head_scores/` whose recorded config equals `cfg` (the engine
    sees the model only through its config). Raises FileNotFoundError naming the model and
    the expected file when there is none, ValueError when a file is for another model.
    """
    if spec is None:
        files = sorted(SCORES_DIR.glob("*.json"))
        hits = [p for p in files if _matches(json.loads(p.read_text()), cfg)]
        if not hits:
            have = ", ".join(p.name for p in files) or "none"
            raise FileNotFoundError(
                f"headkv: no head scores for this model ({describe(cfg)}): expected "
                f"{SCORES_DIR}/<model name>.json recorded for this config (present: {have}). "
                f"Compute them with `{SCRIPT}`, or pass head_scores=<file>")
        if len(hits) > 1:
            raise ValueError(f"headkv: several head-score files match this model "
                             f"({describe(cfg)}): {', '.join(p.name for p in hits)}; pick one "
                             f"with head_scores=<name>")
        path = hits[0]
    else:
        path = Path(spec)
        if not path.suffix:  # a model name
            path = SCORES_DIR / f"{spec}.json"
        if not path.exists():
            raise FileNotFoundError(
                f"headkv: no head scores for model {spec!r}: expected {path}. Compute them "
                f"with `{SCRIPT}`")
    data = json.loads(path.read_text())
    if "config" in data and not _matches(data, cfg):
        raise ValueError(f"headkv: {path} holds head scores for another model "
                         f"({describe(ModelConfig.from_hf(data['config']))}), not this one "
                         f"({describe(cfg)})")
    s = np.asarray(data["head_scores"], np.float64)
    if s.shape != (cfg.num_layers, cfg.num_heads):
        raise ValueError(f"headkv: {path} has head scores of shape {s.shape}; this model needs "
                         f"[layers, query heads] = ({cfg.num_layers}, {cfg.num_heads})")
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        raise ValueError(f"headkv: {path} has negative or non-finite head scores")
    s.setflags(write=False)
    return s


# ---- budgets -------------------------------------------------------------------------

def budget_table(scores_LH: Float[np.ndarray, "L H"], budget: int, window: int, beta: float,
                 temp: float, num_kv_heads: int) -> Int[np.ndarray, "L K"]:
    """HeadKV's per-(layer, KV head) budgets, window included (module docstring)."""
    L, H = scores_LH.shape
    s = np.asarray(scores_LH, np.float64)
    # all-zero scores (a model no head of which looks at the needle): a uniform share
    p = s / s.sum() if s.sum() > 0 else np.full_like(s, 1.0 / s.size)
    p = p**temp
    p = p / p.sum()
    p_LK = p.reshape(L, num_kv_heads, H // num_kv_heads).sum(-1)
    base = budget - window
    pooled = base // beta  # Python float floor division, as the authors' code
    b = np.round(p_LK * pooled * L * num_kv_heads + (base - pooled))
    return (b + window).astype(np.int32)
