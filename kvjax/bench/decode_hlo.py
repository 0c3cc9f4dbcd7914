"""Whether decode's appends stay in place: cache-sized copies in the compiled decode loop.

    PYTHONPATH=. python3 -m kvjax.bench.decode_hlo      # the 8B shape's layers, this backend
    python -m kvjax.bench.decode_hlo --small            # tiny shapes (CPU)

An append at the cache's end is one `dynamic_update_slice`, done in place when nothing
else needs the old buffer. A program whose step copies a layer's K or V instead pays for
the whole cache every token, which no timing of the step separates from the attention's
own reads. This compiles `engine.steps.decode` for abstract shapes (nothing runs, no
weights are made) with each `Kernels.decode_layers` layout, and counts the `copy` ops in
the optimized HLO whose shape is a layer's K or V ([B, K, C, Dh]) or the stacked cache's
([L, B, K, C, Dh]). On CPU (jax 0.10) the per-layer loop copies each layer's K and V twice a
step at batch 1 (XLA fuses a second copy of the append into the attention, across the
bitcast that drops the size-1 batch axis) and never at batch 2; the scan copies none.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp

from kvjax.bench.gpu import shape_8b

_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def decode_program(cfg, batch: int, capacity: int, layout: str, dtype=jnp.bfloat16,
                   storage: str = "stacked"):
    """`steps.decode` compiled for abstract shapes: the full cache's plain decode step
    (`Method()`), 16 new tokens, the layers' weights stored as `storage`
    (`transformer.store_layers`)."""
    from kvjax.compression.cache import KVCache
    from kvjax.compression.method import Method
    from kvjax.engine import steps
    from kvjax.engine.sampling import Sampling
    from kvjax.pallas.dispatch import Kernels
    from kvjax.train import init_params

    from kvjax.models import transformer

    params = jax.eval_shape(lambda: transformer.store_layers(jax.tree.map(
        lambda w: w.astype(dtype), init_params(cfg, jax.random.PRNGKey(0))), storage))
    L, B, K, C, D = cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim
    sds = jax.ShapeDtypeStruct
    cache = KVCache(sds((L, B, K, C, D), dtype), sds((L, B, K, C, D), dtype),
                    sds((L, B, K, C), jnp.int32), sds((L, B, K, C), jnp.bool_),
                    sds((), jnp.int32), sds((B,), jnp.int32))
    logits = sds((B, cfg.vocab_size), jnp.float32)
    return steps.decode.lower(
        params, cache, logits, jax.random.PRNGKey(0), None, cfg=cfg, method=Method(),
        max_new=16, sampling=Sampling(), stop_ids=(2,),
        kernels=Kernels(decode_layers=layout)).compile()


def cache_copies(compiled, cfg, batch: int, capacity: int, dtype=jnp.bfloat16) -> int:
    """Copies of a layer's (or the stacked) K/V buffer in a `decode_program`'s optimized
    HLO."""
    L, B, K, C, D = cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim
    dt = _DTYPES[jnp.dtype(dtype).name]
    shapes = {f"{dt}[{B},{K},{C},{D}]", f"{dt}[{L},{B},{K},{C},{D}]"}
    return sum(1 for m in re.finditer(r"= (\w+\[[\d,]*\])\{[^}]*\} copy\(",
                                      compiled.as_text()) if m.group(1) in shapes)


def temp_gib(compiled) -> float | None:
    """The program's temporaries (XLA's `memory_analysis`; None where the backend gives
    none): what it allocates beyond its arguments and outputs, e.g. a per-layer loop's
    copies of the stacked weights and cache (`steps.decode` splits them once a call)."""
    m = compiled.memory_analysis()
    return None if m is None else m.temp_size_in_bytes / 2**30


# (decode layer loop, layer storage): the scan, the per-layer loop over a stacked model
# (splits its weights once a call), and over a model stored per layer (`Model.with_layers`)
LAYOUTS = (("scan", "stacked"), ("per_layer", "stacked"), ("per_layer", "per_layer"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.decode_hlo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU)")
    p.add_argument("--layers", type=int, default=4,
                   help="layers of the shape (each layer's program is the same)")
    p.add_argument("--cases", default="32768x1,8192x8,8192x1",
                   help="CAPACITYxBATCH comma list")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="weights and cache dtype (default bfloat16, float32 with --small); on "
                        "CPU float32 shows the temporaries a GPU has: XLA's CPU dots upcast "
                        "bfloat16 operands, which adds a float32 copy of the weights")
    a = p.parse_args(argv)
    cases = "512x1,512x2" if a.small else a.cases
    cfg = shape_8b(a.layers, a.small, max(int(c.split("x")[0]) for c in cases.split(",")))
    dtype = jnp.dtype(a.dtype) if a.dtype else jnp.float32 if a.small else jnp.bfloat16
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; {a.layers} layers, "
          f"kv heads {cfg.num_kv_heads}, head dim {cfg.head_dim}, {jnp.dtype(dtype).name}")
    from kvjax.train import init_params

    size = jnp.dtype(dtype).itemsize / 2**30
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    weights = sum(x.size for x in jax.tree.leaves(shapes)) * size
    layers = sum(x.size for x in jax.tree.leaves(shapes["layers"])) * size
    print(f"weights {weights:.3f} GiB, of which the stacked layers' {layers:.3f} (what a "
          "per-layer loop splits)")
    print("| capacity | batch | decode layers | layers stored | K/V-sized copies in the "
          "decode program | K and V GiB | temporaries GiB |")
    print("|---|---|---|---|---|---|---|")
    for c in cases.split(","):
        n, b = (int(v) for v in c.split("x"))
        kv = 2 * cfg.num_layers * b * cfg.num_kv_heads * n * cfg.head_dim * size
        for layout, storage in LAYOUTS:
            prog = decode_program(cfg, b, n, layout, dtype, storage)
            t = temp_gib(prog)
            print(f"| {n} | {b} | {layout} | {storage} | "
                  f"{cache_copies(prog, cfg, b, n, dtype)} | {kv:.3f} | "
                  f"{'-' if t is None else f'{t:.3f}'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
