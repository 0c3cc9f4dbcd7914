"""Teacher-forced answer-token accuracy per training task: is retrieval forming yet?

    python scripts/probe_training.py --step 500            # orbax state in --workdir
    python scripts/probe_training.py --model kvjax/assets/tiny-retrieval --context 256

Cheaper than `python -m kvjax.run` (one forward pass per batch, no generation) and it
includes the training-only `copy` task: copy accuracy near the unigram level means no
induction heads yet, and no task can retrieve without them. Batches are drawn from steps
the run never trains on (10_000 + i), with the config's task definitions.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import numpy as np

from kvjax import train


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/models/tiny-retrieval.yaml")
    p.add_argument("--workdir", type=Path, default=Path("runs/tiny-retrieval"))
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--step", type=int, help="orbax checkpoint step in --workdir")
    g.add_argument("--model", help="HF checkpoint directory")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--tasks", help="comma-separated training tasks (default: the config's `tasks`)")
    a = p.parse_args(argv)
    cfg, tc, _ = train.load_configs(a.config)
    if a.model:
        from kvjax.models.checkpoint import load_hf

        cfg, params = load_hf(a.model)
    else:
        import orbax.checkpoint as ocp

        mngr = ocp.CheckpointManager(a.workdir.resolve() / "ckpt")
        cfg, params, _ = train.restore(mngr, a.step, cfg, tc)
    aux = jax.jit(lambda prm, b: train.loss_fn(prm, cfg, b, tc.lm_weight, False)[1])
    # any training task, the config's mixture by default
    names = a.tasks.split(",") if a.tasks else [n for n, _ in tc.tasks]
    for name in names:
        one = dataclasses.replace(tc, tasks=((name, 1.0),), curriculum=((0, a.context, 16),))
        acc = [float(aux(params, train.make_batch(one, 10_000 + i))["answer_token_acc"])
               for i in range(a.batches)]
        print(f"{name:18s} {np.mean(acc):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
