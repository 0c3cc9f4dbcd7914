"""H2O's column sums with and without the prompt attention's log-sum-exp, in one run (issue 38).

    python -m kvjax.bench.column_sums                  # SmolLM2-135M's shapes, 2048, batch 8
    python -m kvjax.bench.column_sums --contexts 2048,4096 --batch 1

One layer, random q/k/v of the given shapes, a causal prompt:
  attention            `attention.attend_blocked` (the CPU's prompt attention)
  attention+lse        the same, also returning each query's log-sum-exp (`with_lse`)
  sums, two passes     `scoring.cumulative_attention` (tiled): a pass for each query's
                       log-sum-exp, a second adding exp(s - lse) into the columns
  sums, given lse      the same with the attention's log-sum-exp (`LayerIO.lse`): one pass
The four run in turn, `--repeats` rounds (this machine's speed drifts over minutes); times
are each one's best round. Printed: the times, sums given / two passes, and the largest
difference between the two sums relative to their largest value.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from kvjax.compression import scoring
from kvjax.models import attention


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.column_sums", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--groups", type=int, default=3, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=256, help="the column sums' tile")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    B, K, G, D = a.batch, a.kv_heads, a.groups, a.head_dim
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} B={B} K={K} G={G} "
          f"Dh={D} block={a.block} fp32; one layer, best of {a.repeats} interleaved rounds")
    print(f"{'context':>7} {'attention':>10} {'+lse':>8} {'sums_2pass':>10} {'sums_lse':>9} "
          f"{'lse/2pass':>9} {'max_rel_diff':>12}   (ms)")
    for T in map(int, a.contexts.split(",")):
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(T), 3)
        q = jax.random.normal(kq, (B, T, K * G, D), jnp.float32)
        k, v = (jax.random.normal(x, (B, K, T, D), jnp.float32) for x in (kk, kv))
        valid = jnp.ones((B, T), bool)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        kpos, kvalid = (jnp.broadcast_to(x[:, None], (B, K, T)) for x in (pos, valid))

        def attend(q, k, v, with_lse):
            return attention.attend_blocked(q, k, v, pos, kpos, kvalid, None, ordered=True,
                                            with_lse=with_lse)

        def sums(q, k, lse):
            return scoring.cumulative_attention(q, k, pos, valid, kpos, kvalid, a.block,
                                                tiled=True, lse_BKGT=lse)

        att = jax.jit(lambda q, k, v: attend(q, k, v, False))
        att_lse = jax.jit(lambda q, k, v: attend(q, k, v, True))
        two = jax.jit(lambda q, k: sums(q, k, None))
        one = jax.jit(sums)
        lse = att_lse(q, k, v)[1]
        runs = {"attention": lambda: att(q, k, v), "+lse": lambda: att_lse(q, k, v),
                "two": lambda: two(q, k), "one": lambda: one(q, k, lse)}
        for f in runs.values():
            jax.block_until_ready(f())  # compiles
        best = {n: float("inf") for n in runs}
        for _ in range(a.repeats):
            for n, f in runs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f())
                best[n] = min(best[n], time.perf_counter() - t0)
        ref, got = runs["two"](), runs["one"]()
        diff = float(jnp.max(jnp.abs(ref - got)) / jnp.max(jnp.abs(ref)))
        ms = {n: 1e3 * t for n, t in best.items()}
        print(f"{T:7d} {ms['attention']:10.1f} {ms['+lse']:8.1f} {ms['two']:10.1f} "
              f"{ms['one']:9.1f} {best['one'] / best['two']:9.2f} {diff:12.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
