"""HeadKV head scores for any model kvjax loads (bundled name or HF checkpoint directory).

    python -m kvjax.headkv_scores --model tiny-retrieval          # ~20 s on 2 CPU cores

Recipe (HeadKV, Fu et al. ICLR 2025, Sec. 3.1; `kvjax/methods/baselines/head_scores.py` has the formulas): needle
prompts of the bundled tasks (`kvjax.tasks`: niah_single and niah_multikey, whose answer is
needle 0), the answer teacher-forced after the prompt (one forward pass; the authors decode
greedily, which for a model that answers right is the same sequence, and teacher forcing
keeps the score defined for a model that does not), the attention rows of the queries that
write the answer, then per head the retrieval-reasoning score (`--score reason`, default) or
the retrieval (copy) score (`--score copy`), averaged over samples.

Writes `kvjax/assets/head_scores/<model name>.json`: the [layers, query heads] scores, the
model's config (how `headkv` finds the file) and the sha256 of its weights (tests check the
bundled file still matches the bundled weights).

NOTE: on the bundled `tiny-retrieval` (step 6700, MODEL.md) the four query heads of layer 1
lead with reason scores 0.61 / 0.56 / 0.51 / 0.50 (the second layer of the 2-layer part of
its training, where induction formed), then layer 9 head 3 at 0.06. Recompute them (this
script, ~10 s) whenever the model is re-exported;
`tests/test_headkv.py` fails while the file's weights hash differs from the bundled weights.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax import tasks
from kvjax.config import ModelConfig
from kvjax.engine.layers import prefill_layers
from kvjax.methods.baselines import head_scores as headkv
from kvjax.models import attention
from kvjax.models.checkpoint import weights_sha256
from kvjax.tasks import tokenizer as task_tok

TASKS = ("niah_single", "niah_multikey", "passkey")  # tasks whose answer sits in needle 0



def answer_attention(q_BTHD: Float[Array, "B T H D"], k_BKTD: Float[Array, "B K T D"],
                     A: int, sliding_window: int | None = None) -> Float[Array, "B H A T"]:
    """Causal softmax attention of the last A queries over every key, per query head
    (h = k * G + g, repeat_kv order), exactly as the model attends (fp32, 1/sqrt(d))."""
    B, T, H, D = q_BTHD.shape
    K = k_BKTD.shape[1]
    s = attention.logits(q_BTHD[:, T - A:], k_BKTD)  # [B, K, G, A, T]
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    kpos = jnp.broadcast_to(pos[:, None], (B, K, T))
    ok = attention.mask(pos[:, T - A:], kpos, jnp.ones((B, K, T), bool), sliding_window)
    return attention.softmax(s, ok).reshape(B, H, A, T)


@functools.partial(jax.jit, static_argnames=("cfg", "A"))
def answer_probs(params, tokens_BT: Int[Array, "B T"], *, cfg: ModelConfig, A: int
                 ) -> Float[Array, "L B H A T"]:
    """One teacher-forced forward pass of prompt + answer[:-1]: the attention rows of the
    A queries that write the answer tokens, every layer."""
    B, T = tokens_BT.shape
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    def hook(io, st):
        return answer_attention(io.q, io.k, A, cfg.sliding_window), st

    _, probs, _ = prefill_layers(params, cfg, tokens_BT, jnp.ones((B, T), bool), pos, hook)
    return probs


def needle_span(ids: list[int], needle: list[int]) -> tuple[int, int]:
    """[start, end) of `needle` in `ids`: the exact match, else the window of its length
    sharing the most distinct tokens with it (the authors' `find_needle_idx`, for
    tokenizers that split the needle differently in context)."""
    n = len(needle)
    for i in range(len(ids) - n + 1):
        if ids[i: i + n] == needle:
            return i, i + n
    want = set(needle)
    best = max(range(len(ids) - n + 1), key=lambda i: (len(want & set(ids[i: i + n])), -i))
    return best, best + n


def encode_sample(model, sample) -> tuple[list[int], list[int], tuple[int, int]]:
    """(BOS + prompt ids, answer ids, needle span) in the model's own tokenizer."""
    prompt = model.encode(sample.prompt)
    answer = model.encode(sample.target, bos=False)
    start, end = sample.meta["needle_positions"][0]  # in the task tokenizer's BOS + prompt
    if task_tok.is_task_tokenizer(model.tokenizer):
        return prompt, answer, (start, end)
    task_ids = [task_tok.BOS_ID, *task_tok.encode(sample.prompt)]
    text = task_tok.decode(task_tok.default_tokenizer(), task_ids[start:end])
    return prompt, answer, needle_span(prompt, model.encode(text, bos=False))


def compute(model, task_names, contexts, samples: int, seed: int, kind: str) -> np.ndarray:
    """[L, H] mean over samples of the per-sample head scores."""
    per_sample = []
    for name in task_names:
        for ctx in contexts:
            for s in tasks.generate(name, context_length=ctx, n=samples, seed=seed):
                prompt, answer, (a, b) = encode_sample(model, s)
                ids = np.asarray(prompt + answer[:-1])
                p = answer_probs(model.params, ids[None], cfg=model.cfg, A=len(answer))
                p = np.asarray(p[:, 0], np.float64)  # [L, H, A, T]
                needle = np.zeros(len(ids), bool)
                needle[a:b] = True
                if kind == "reason":
                    per_sample.append(headkv.reason_score(p, needle))
                else:
                    per_sample.append(headkv.copy_score(p, needle, ids, np.asarray(answer)))
    return np.mean(per_sample, axis=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-retrieval", help="bundled name or HF checkpoint dir")
    p.add_argument("--tasks", default="niah_single,niah_multikey")
    p.add_argument("--contexts", default="256,512,1024", help="context lengths (tokens)")
    p.add_argument("--samples", type=int, default=10, help="per task and context")
    p.add_argument("--seed", type=int, default=1234, help="not the evaluation seed (0)")
    p.add_argument("--score", choices=headkv.SCORE_KINDS, default="reason")
    p.add_argument("--output", type=Path, default=None,
                   help="default: kvjax/assets/head_scores/<model name>.json")
    args = p.parse_args(argv)
    names = [t for t in args.tasks.split(",") if t]
    bad = sorted(set(names) - set(TASKS))
    if bad:
        p.error(f"--tasks {bad}: the score needs the answer in needle 0; allowed: {TASKS}")

    import kvjax

    t0 = time.perf_counter()
    model = kvjax.load(args.model)
    if model.tokenizer is None:
        p.error(f"model {args.model!r} has no tokenizer.json: the needle prompts are text")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    scores = compute(model, names, contexts, args.samples, args.seed, args.score)
    out = args.output or headkv.SCORES_DIR / f"{model.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "model": model.name,
        "note": "HeadKV head scores (python -m kvjax.headkv_scores); recompute when the weights change",
        "score": args.score,
        "tasks": names,
        "contexts": contexts,
        "samples": args.samples,
        "seed": args.seed,
        "weights_sha256": weights_sha256(model.path),
        "config": model.cfg.to_hf(),
        "head_scores": [[round(float(x), 6) for x in row] for row in scores],
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    top = np.dstack(np.unravel_index(np.argsort(-scores, axis=None)[:5], scores.shape))[0]
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s; top heads (layer, head): "
          + ", ".join(f"({l}, {h}) {scores[l, h]:.3f}" for l, h in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
