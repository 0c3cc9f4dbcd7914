"""How many steps until induction heads form? A diagnostic for the bundled model's recipe.

    python scripts/induction_probe.py --layers 2 --words 0:64 --context 24 --steps 300
    python scripts/induction_probe.py --layers 2 --words 0:64,300:1300 --grow 300:12 --steps 900

Trains a model of the bundled architecture (hidden 128, 4/2 heads of 32, the tokenizer's
1408-entry vocabulary) on copy examples of uniform random tokens only: `context - span - 1`
tokens among N (`--words step:N,...`: N from that step on; the N token ids from 16 on, i.e.
the last 11 punctuation marks, then words), the token at a random position again, then the
`span` tokens that followed it. Only the repeat is predictable, so answer accuracy above
1/N means an induction circuit. `--grow step:L` deepens the model to L layers at that step
by stacking new layers whose output projections (o, down) are zero: the function, and the
copy accuracy, are unchanged there (progressive stacking). Prints loss and answer accuracy
every 100 steps.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from kvjax import train
from kvjax.config import ModelConfig


def batch(rng, context: int, span: int, vocab: int, bs: int) -> dict:
    n = context - span - 1
    b = {k: np.zeros((bs, context - 1), dt) for k, dt in
         (("inputs", np.int32), ("labels", np.int32), ("answer_mask", np.float32))}
    for i in range(bs):
        ids = rng.integers(16, 16 + vocab, n)
        s = int(rng.integers(0, n - span))
        seq = np.concatenate([[1], ids, [ids[s]], ids[s + 1: s + span]])
        b["inputs"][i], b["labels"][i] = seq[:-1], seq[1:]
        b["answer_mask"][i, n + 1:] = 1  # what follows the repeated token
    b["valid"] = np.ones_like(b["inputs"], bool)
    b["context_mask"] = np.zeros_like(b["answer_mask"])
    return b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for name, typ, default in (("layers", int, 2), ("context", int, 24), ("span", int, 8),
                               ("batch", int, 64), ("lr", float, 3e-3), ("steps", int, 600),
                               ("seed", int, 0), ("words", str, "0:64"), ("grow", str, "")):
        p.add_argument(f"--{name}", type=typ, default=default)
    a = p.parse_args(argv)
    at = lambda spec: dict(tuple(map(int, x.split(":"))) for x in spec.split(",") if x)  # noqa
    words, grows = at(a.words), at(a.grow)
    cfg = ModelConfig(family="llama", vocab_size=1408, hidden_size=128, intermediate_size=384,
                      num_layers=a.layers, num_heads=4, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    tc = train.TrainConfig(seed=a.seed, steps=a.steps, lr=a.lr, lm_weight=0.0)
    params = train.init_params(cfg, jax.random.PRNGKey(a.seed))
    opt = train.optimizer(tc)
    opt_state, update, t0 = opt.init(params), train.update_fn(cfg, tc, opt), time.perf_counter()
    for step in range(a.steps):
        if step in grows:
            params, cfg = train.grow(params, cfg, grows[step], jax.random.PRNGKey(a.seed + step))
            opt_state, update = opt.init(params), train.update_fn(cfg, tc, opt)
        vocab = words[max(s for s in words if s <= step)]
        b = batch(np.random.default_rng([a.seed, step]), a.context, a.span, vocab, a.batch)
        params, opt_state, loss, aux = update(params, opt_state, b)
        if (step + 1) % 100 == 0:
            print(json.dumps({"step": step + 1, "layers": cfg.num_layers, "vocab": vocab,
                              "loss": round(float(loss), 3),
                              "answer_acc": round(float(aux["answer_token_acc"]), 3),
                              "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
