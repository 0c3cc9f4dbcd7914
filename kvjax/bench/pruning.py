"""SlimInfer vs full and LazyLLM: TTFT and decode speed, one run.

    python -m kvjax.bench.pruning                       # bundled model, 2048/4096/8192
    python -m kvjax.bench.pruning --model random --contexts 512,1024 --new-tokens 8

For each context and method: compile time (apart, not timed), TTFT (prefill + pruning,
the logits of the last prompt token included) and its ratio to `full` measured in this
run, decode tokens/s and its ratio, the computed prefill FLOP ratio (per-layer token
counts of the run, `kvjax.methods.slim.blocks.prefill_flop_ratio`), device-resident KV
bytes vs a full cache (SlimInfer: mean over decode steps; the others: after prefill), and
SlimInfer's fraction of decode steps that swapped blocks. Batch 1, greedy, `--repeats`
timed runs after one that compiles (median).

SlimInfer decodes in a host loop of one compiled step per token (host <-> device block
swaps happen between steps), `full` and LazyLLM in the engine's single compiled loop: the
decode ratio includes that per-step dispatch and host bookkeeping.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np


def _kv_fraction(stats: dict) -> float:
    if "device_kv_bytes" in stats:
        return stats["device_kv_bytes"][0] / stats["device_kv_bytes_full"][0]
    return stats["kv_bytes_live"] / stats["kv_bytes_full"]


def main(argv=None) -> int:
    from kvjax import methods, tasks
    from kvjax.bench.decode import kvjax_run, load_model
    from kvjax.methods.slim.blocks import prefill_flop_ratio
    from kvjax.cli.args import overrides

    p = argparse.ArgumentParser(prog="python -m kvjax.bench.pruning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-retrieval",
                   help="bundled model, checkpoint directory, or `random`")
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--methods", default="full,lazyllm,sliminfer")
    p.add_argument("--task", default="niah_single")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a hyperparameter of the methods that have it")
    a = p.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    model = load_model(a.model, max(contexts) + a.new_tokens + 8)
    cfg = model.cfg
    print(f"model={model.name} layers={cfg.num_layers} hidden={cfg.hidden_size} heads="
          f"{cfg.num_heads}/{cfg.num_kv_heads} | jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind} | {a.new_tokens} new tokens, batch 1")
    print(f"{'context':>7} {'method':>12} {'compile_s':>9} {'ttft_ms':>9} {'ttft/full':>9} "
          f"{'tok/s':>8} {'tok/s/full':>10} {'flop_ratio':>10} {'kv/full':>7} {'swap_frac':>9}")
    for n in contexts:
        s = tasks.generate(a.task, context_length=n, n=1, seed=0)[0]
        ids = model.encode(s.prompt) if model.tokenizer is not None else \
            np.random.default_rng(0).integers(3, cfg.vocab_size, n).tolist()
        base = None
        for name in a.methods.split(","):
            fields = {f.name for f in dataclasses.fields(methods.get(name))}
            m = methods.create(name, **{k: v for k, v in overrides(a.set).items() if k in fields})
            comp, ttft, tpot, _, st = kvjax_run(model, ids, m, a.new_tokens, a.repeats)
            base = (ttft, tpot) if name == "full" else base
            flops = prefill_flop_ratio(cfg, st["layer_tokens"][0], len(ids)) \
                if "layer_tokens" in st else 1.0
            swap = f"{st['swap_step_fraction'][0]:9.3f}" if "swap_step_fraction" in st else \
                f"{'-':>9}"
            r1 = f"{ttft / base[0]:9.3f}" if base else f"{'-':>9}"
            r2 = f"{base[1] / tpot:10.3f}" if base else f"{'-':>10}"
            print(f"{len(ids):>7} {name:>12} {comp:>9.2f} {ttft * 1e3:>9.1f} {r1} "
                  f"{1 / tpot:>8.1f} {r2} {flops:>10.3f} {_kv_fraction(st):>7.3f} {swap}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
