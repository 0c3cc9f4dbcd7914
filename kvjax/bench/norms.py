"""CriticalKV's projected value norms, blockwise vs materialising, in one run (issue 9).

    python -m kvjax.bench.norms                       # Llama-3-8B-shaped, 1k/4k/8k tokens
    python -m kvjax.bench.norms --contexts 512 --hidden 128 --kv-heads 2 --groups 2 \
        --head-dim 64                                   # the bundled model's shapes

`||V_i W_O^h||_1`, mean over the G query heads of each KV head, for every prompt entry:
`kvjax.methods.critical.projected_norms.projected_value_norms` (lax.map over blocks of `--block` tokens, at most
[B, K, G, block, hidden] at once) against `projected_value_norms_dense` ([B, K, G, n,
hidden] at once). Per context: median time over `--repeats` runs after a compile, the
compiled program's temporary buffer bytes (XLA's `memory_analysis`: what the program
allocates beyond its inputs and outputs), both ratios measured in this run, and the
largest difference between the two results. The overhead of the critical rule in a whole
prefill is `python -m kvjax.bench.prefill --methods snapkv,critical_snapkv,ada_snapkv,critical_adakv`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.bench.kernels import timed
from kvjax.methods.critical.projected_norms import (
    projected_value_norms,
    projected_value_norms_dense,
)


def temp_bytes(exe) -> int | None:
    """Bytes of a compiled program's temporaries; None where the backend does not say."""
    analysis = exe.memory_analysis()
    return getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.norms", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,8192")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    K, G, Dh, hidden = a.kv_heads, a.groups, a.head_dim, a.hidden
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} K={K} G={G} "
          f"Dh={Dh} hidden={hidden} block={a.block} fp32")
    print(f"{'context':>7} {'form':>9} {'time_ms':>9} {'vs_dense':>8} {'temp_MiB':>9} "
          f"{'vs_dense':>8} {'max_rel_diff':>12}")
    blockwise = jax.jit(lambda v, w: projected_value_norms(v, w, block=a.block))
    dense = jax.jit(projected_value_norms_dense)
    for n in map(int, a.contexts.split(",")):
        kv, kw = jax.random.split(jax.random.PRNGKey(n))
        v = jax.random.normal(kv, (1, K, n, Dh), jnp.float32)
        wo = 0.02 * jax.random.normal(kw, (K * G * Dh, hidden), jnp.float32)
        exes = {name: fn.lower(v, wo).compile()  # once: timed and measured
                for name, fn in (("dense", dense), ("blockwise", blockwise))}
        rows = {name: (timed(exe, (v, wo), a.repeats), temp_bytes(exe), exe(v, wo))
                for name, exe in exes.items()}
        t0, m0, ref = rows["dense"]
        for name, (t, m, out) in rows.items():
            diff = float(np.max(np.abs(np.asarray(out) - np.asarray(ref)) / np.abs(np.asarray(ref))))
            mem = f"{m / 2**20:9.1f} {m / m0:8.3f}" if m is not None and m0 else f"{'-':>9} {'-':>8}"
            print(f"{n:>7} {name:>9} {t * 1e3:9.2f} {t / t0:8.3f} {mem} {diff:12.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
