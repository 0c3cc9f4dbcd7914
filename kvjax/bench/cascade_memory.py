"""Device memory of LAVa's and CAKE's cascading prefill against a full prefill, one run.

    python -m kvjax.bench.cascade_memory --contexts 2048,4096,8192 --budget 128

For every context, the engine's prefill program (`engine.steps.prefill`, the cache at the
method's own slot count, no decoding headroom) is compiled for `full` (every layer's K/V
kept), and, per method, with `cascade=false` (every layer prefilled at full length, the
budgets decided after the scan) and cascading (each finished layer compacted into the
bounded buffer, `kvjax.methods.lava.cascade`). Printed from XLA's compiled memory analysis
(`jax.jit(...).lower(...).compile().memory_analysis()`): temp bytes (intermediates, the
scan carry included), output bytes (the cache and the statistics), and `peak`, their sum:
the program's device allocation beyond its arguments (weights and tokens, the same for
every row), with its ratio to `full`'s measured in the same run. The first row,
`forward`, is the same prefill keeping no cache at all (the model's own working set: one
layer's activations, attention blocks, MLP); `kv` = peak - forward's peak is what keeping
a cache costs, with its ratio to `full`'s. `--reference snapkv` adds a per-layer eviction
at the same budget: window scoring and a budget-sized cache, with no cascade to carry.
Beside them, for scale: the full cache (`full_kv`, L * K * n entries) and the cascade's
static layout (`slots_kv`, L * K * S entries, S = window + the head cap's slots), in MiB.

The model is the bundled architecture (`--model random`: random weights, positions
extended to the longest context) or a named/bundled checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp


def program_bytes(model, method, n: int) -> dict[str, int]:
    """XLA's memory analysis of the prefill program of an n-token prompt."""
    from kvjax.engine import steps

    tokens = jnp.ones((1, n), jnp.int32)
    valid = jnp.ones((1, n), bool)
    capacity = method.cache_slots(n, model.cfg)
    ma = steps.prefill.lower(model.params, tokens, valid, cfg=model.cfg, method=method,
                             capacity=capacity).compile().memory_analysis()
    return {"temp": ma.temp_size_in_bytes, "out": ma.output_size_in_bytes,
            "peak": ma.temp_size_in_bytes + ma.output_size_in_bytes}


def forward_bytes(model, n: int) -> dict[str, int]:
    """The memory analysis of the prefill keeping no cache (the last token's logits only)."""
    from kvjax.engine.inputs import positions
    from kvjax.engine.layers import prefill_layers
    from kvjax.models import transformer

    cfg = model.cfg

    def fwd(params, tokens, valid):
        pos = positions(valid, jnp.zeros((1,), jnp.int32))
        x, _, _ = prefill_layers(params, cfg, tokens, valid, pos, lambda io, st: (None, st))
        return transformer.unembed(params, cfg, x[:, -1])

    ma = jax.jit(fwd).lower(model.params, jnp.ones((1, n), jnp.int32),
                            jnp.ones((1, n), bool)).compile().memory_analysis()
    return {"temp": ma.temp_size_in_bytes, "out": ma.output_size_in_bytes,
            "peak": ma.temp_size_in_bytes + ma.output_size_in_bytes}


def rows(model, names: list[str], n: int, budget: int, overrides: dict,
         references: tuple[str, ...] = ()):
    """[(label, bytes, slots)]: forward, full, the references (a per-layer eviction at
    the same budget: what scoring and a budget-sized cache cost without a cascade), and
    each method without and with the cascade."""
    from kvjax import methods
    from kvjax.compression.method import Method

    out = [("forward", forward_bytes(model, n), 0), ("full", program_bytes(model, Method(), n), n)]
    for name in references:
        m = methods.create(name, budget=budget)
        out.append((name, program_bytes(model, m, n), m.cache_slots(n, model.cfg)))
    for name in names:
        fields = {f.name for f in dataclasses.fields(methods.get(name))}
        kw = {k: v for k, v in overrides.items() if k in fields}
        for cascade in (False, True):
            m = methods.create(name, budget=budget, **{**kw, "cascade": cascade})
            m.validate(n, model.cfg)
            label = name if cascade else f"{name}/cascade=false"
            out.append((label, program_bytes(model, m, n), m.cache_slots(n, model.cfg)))
    return out


def main(argv=None) -> int:
    from kvjax.bench.prefill import model_for
    from kvjax.cli.args import overrides

    p = argparse.ArgumentParser(prog="python -m kvjax.bench.cascade_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random")
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--methods", default="lava,cake")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--reference", default="snapkv",
                   help="per-layer eviction methods to print beside (comma list, or empty)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a hyperparameter of the methods that have it")
    a = p.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    model = model_for(a.model, max(contexts))
    cfg = model.cfg
    L, K = cfg.num_layers, cfg.num_kv_heads
    per_entry = 2 * cfg.head_dim * jax.tree.leaves(model.params)[0].dtype.itemsize
    mib = 2.0 ** 20
    print(f"model={model.name} layers={L} kv_heads={K} head_dim={cfg.head_dim} "
          f"budget={a.budget} device={jax.devices()[0].device_kind} jax={jax.__version__}")
    print(f"{'context':>7} {'method':>20} {'temp_MiB':>9} {'out_MiB':>8} {'peak_MiB':>9} "
          f"{'vs_full':>7} {'kv_MiB':>8} {'kv_vs_full':>10} {'full_kv':>8} {'slots_kv':>8}")
    for n in contexts:
        refs = tuple(x for x in a.reference.split(",") if x)
        got = rows(model, a.methods.split(","), n, a.budget, overrides(a.set), refs)
        floor, base = got[0][1]["peak"], got[1][1]["peak"]
        for label, b, S in got:
            kv = b["peak"] - floor
            print(f"{n:>7} {label:>20} {b['temp'] / mib:>9.2f} {b['out'] / mib:>8.2f} "
                  f"{b['peak'] / mib:>9.2f} {b['peak'] / base:>7.3f} {kv / mib:>8.2f} "
                  f"{kv / (base - floor):>10.3f} {L * K * n * per_entry / mib:>8.2f} "
                  f"{L * K * S * per_entry / mib:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
