"""Prefill time (TTFT) of layer-wise selection methods vs the full cache, one run.

    python -m kvjax.bench.prefill --contexts 2048,4096 --methods full,asl,fastkv,gemfilter

Prints, per context and method: compile time (apart), median TTFT over `--repeats` runs,
the ratio to `full` measured in this run, the selection layer each prompt used, and
ASL's Appendix B prediction for that layer, `(L_sel+1)/L + (L-L_sel-1)/L * k/n` (attention
and MLP work only; the measured ratio adds scoring and gathering overhead). Decode time
per token with the compressed cache is printed beside it, and, for the methods that
measure it (LAVa, CAKE: `peak_live_kv_bytes` from the prefill carry), the peak live KV
during prefill and the live KV after it, as fractions of the full cache.

    python -m kvjax.bench.prefill --contexts 1024,2048 --methods full,snapkv,ada_snapkv,cake,lava
    python -m kvjax.bench.prefill --contexts 1024,2048 --methods cake,lava --set cascade=false

`alloc_kv` is the cache decoding runs over, as a fraction of the full cache; `--no-shrink`
adds a row per method that decodes over the prefill's layout (`engine.run(shrink=False)`):
room for one head taking the whole budget, as the cache was before dead slots were dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import numpy as np


def predicted_ratio(sel_layer: int, num_layers: int, k: int, n: int) -> float:
    if sel_layer < 0:
        return 1.0
    return (sel_layer + 1) / num_layers + (num_layers - sel_layer - 1) / num_layers * k / n


def model_for(name: str, max_context: int):
    """The bundled model, a checkpoint directory, or `random` (bundled architecture with
    random weights and room for `max_context` positions)."""
    import kvjax
    from kvjax.train import init_params, load_configs

    if name != "random":
        return kvjax.load(name)
    cfg, _, _ = load_configs("configs/models/tiny-retrieval.yaml")
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(max_context + 64, cfg.max_position_embeddings))
    return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.1), "random")


def main(argv=None) -> int:
    from kvjax import engine, methods, tasks
    from kvjax.cli.args import overrides

    p = argparse.ArgumentParser(prog="python -m kvjax.bench.prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-retrieval")
    p.add_argument("--contexts", default="2048,4096")
    p.add_argument("--methods", default="full,asl,fastkv,gemfilter")
    p.add_argument("--task", default="niah_single")
    p.add_argument("--budget", type=float, default=1 / 16,
                   help="select_k as a fraction of the context (the paper: 2048 of 32k)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a hyperparameter of the methods that have it")
    p.add_argument("--no-shrink", action="store_true",
                   help="also time each method without dropping dead slots before decoding")
    a = p.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    model = model_for(a.model, max(contexts))
    L = model.cfg.num_layers
    print(f"model={model.name} layers={L} device={jax.devices()[0].device_kind} jax={jax.__version__}")
    print(f"{'context':>7} {'method':>16} {'compile_s':>9} {'ttft_ms':>9} {'vs_full':>7} "
          f"{'sel_layer':>9} {'appB_pred':>9} {'tpot_ms':>8} {'tpot_vs_full':>12} {'peak_kv':>7} "
          f"{'live_kv':>7} {'alloc_kv':>8}")
    for n in contexts:
        s = tasks.generate(a.task, context_length=n, n=1, seed=0)[0]
        ids = model.encode(s.prompt) if model.tokenizer is not None else \
            list(np.random.default_rng(0).integers(3, model.cfg.vocab_size, n))
        k = max(int(n * a.budget), 64)
        base = None
        rows = [(x, True) for x in a.methods.split(",")]
        rows += [(x, False) for x in a.methods.split(",") if a.no_shrink and x != "full"]
        for name, shrink in rows:
            fields = {f.name for f in dataclasses.fields(methods.get(name))}
            m = methods.create(name, **{key: v for key, v in overrides(a.set).items()
                                        if key in fields})
            m = m if name == "full" else m.with_budget(k)
            runs = [engine.run(model.params, model.cfg, [ids], m, max_new_tokens=a.decode_tokens,
                               stop_ids=(), shrink=shrink) for _ in range(a.repeats + 1)]
            ttft = statistics.median(r.stats["ttft_s"] for r in runs[1:])
            tpot = statistics.median(r.stats["tpot_s"] for r in runs[1:])
            base = (ttft, tpot) if name == "full" else base
            sel = runs[-1].stats.get("selection_layer", [-1])[0]
            kk = m.resolved(n).select_k if hasattr(m, "resolved") else getattr(m, "select_k", k)
            pred = predicted_ratio(sel, L, kk, n) if name != "full" else 1.0
            rel = f"{ttft / base[0]:7.3f}" if base else "      -"
            relt = f"{tpot / base[1]:12.3f}" if base else "           -"
            st = runs[-1].stats
            full = float(np.sum(st["kv_bytes_full"]))
            peak = f"{np.sum(st['peak_live_kv_bytes']) / full:7.3f}" \
                if "peak_live_kv_bytes" in st else "      -"
            label = name if shrink else f"{name}/noshrink"
            print(f"{n:>7} {label:>16} {runs[0].stats['compile_s']:>9.2f} {ttft * 1e3:>9.1f} {rel} "
                  f"{sel:>9} {pred:>9.3f} {tpot * 1e3:>8.2f} {relt} {peak} "
                  f"{np.sum(st['kv_bytes_live']) / full:7.3f} "
                  f"{np.sum(st['kv_bytes_allocated']) / full:8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
