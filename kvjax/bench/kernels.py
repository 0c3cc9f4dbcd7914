"""Kernel benchmark: each kvjax.pallas op against its xla reference, in one run.

    python -m kvjax.bench.kernels                   # contexts 8k, 32k, 128k (bf16, 8 KV heads,
                                                    # head dim 128, Llama-3-8B-shaped)
    python -m kvjax.bench.kernels --small           # tiny shapes (CPU: xla only)
    python -m kvjax.bench.kernels --hbm-tbs 3.35    # the card's HBM bandwidth, TB/s

Per op and context: median time over `--repeats` runs after a compile, the op's
compulsory bytes (every input read once, every output written once) divided by the
time as a fraction of the HBM bandwidth, and the speedup of the Pallas kernel over xla
measured in the same run. The bandwidth is 3.0 TB/s on an H100 (measured
device-to-device copy, docs/results/gpu.md); on any other device pass `--hbm-tbs`, or the
fraction is not printed. Pallas runs where the backend compiles it (TPU, Hopper GPU);
elsewhere only xla runs and the speedup column is empty.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from kvjax import pallas

KNOWN_TBS = {"H100": 3.0}  # measured on an H100 80GB (device-to-device copy)


@dataclass
class Case:
    op: str
    context: int
    shape: str
    bytes: int
    make: Callable[[str], tuple[Callable, tuple]]  # implementation -> (fn, args)


def _nbytes(*xs) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in xs))


def cases(contexts, *, B, K, G, D, hidden, window, dtype) -> list[Case]:
    H = K * G
    key = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    rnd = lambda shape, scale=1.0: (scale * jax.random.normal(next(key), shape)).astype(dtype)
    out = []
    for n in contexts:
        # decode: one query per head over a full cache of n slots
        q, k, v = rnd((B, H, D)), rnd((B, K, n, D)), rnd((B, K, n, D))
        ok = jnp.ones((B, K, n), bool)
        o = jax.ShapeDtypeStruct((B, H, D), dtype)
        out.append(Case("decode_attention", n, f"B{B} H{H} K{K} S{n} D{D}",
                        _nbytes(q, k, v, ok, o),
                        lambda impl, a=(q, k, v, ok): (jax.jit(lambda *x: pallas.decode_attention(
                            *x, implementation=impl)), a)))
        # window scores of an n-token prompt (window 32, maxpool 7, GQA mean)
        qp, kp = rnd((B, n, H, D)), rnd((B, K, n, D))
        valid = jnp.ones((B, n), bool)
        s = jax.ShapeDtypeStruct((B, K, n - window), jnp.float32)
        out.append(Case("window_scores", n, f"B{B} T{n} H{H} K{K} D{D} w{window}",
                        _nbytes(qp[:, n - window:], kp, valid, s),
                        lambda impl, a=(qp, kp, valid): (jax.jit(lambda *x: pallas.window_scores(
                            *x, window=window, kernel=7, pooling="max", gqa="mean",
                            implementation=impl)), a)))
        # compaction: keep 1/8 of the prompt per head
        S = n // 8
        idx = jnp.sort(jax.random.permutation(next(key), n)[:S])
        idx = jnp.broadcast_to(idx, (B, K, S)).astype(jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, K, n))
        count = jnp.full((B, K), S, jnp.int32)
        moved = 2 * 2 * B * K * S * D * jnp.dtype(dtype).itemsize  # K and V, read + write
        out.append(Case("compact", n, f"B{B} K{K} T{n} S{S} D{D}",
                        moved + _nbytes(idx, count) + 2 * B * K * S * 4,
                        lambda impl, a=(kp, kp, pos, idx, count): (jax.jit(
                            lambda *x: pallas.compact(*x, implementation=impl)), a)))
        # projected value norms against a Llama-3-8B-shaped W_O
        o_w = rnd((H * D, hidden), 0.02)
        norm = jax.ShapeDtypeStruct((B, K, n), jnp.float32)
        out.append(Case("value_norms", n, f"B{B} K{K} T{n} D{D} W_O {H * D}x{hidden}",
                        _nbytes(kp, o_w, norm),
                        lambda impl, a=(kp, o_w): (jax.jit(lambda *x: pallas.value_norms(
                            *x, implementation=impl)), a)))
    return out


def timed(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(arg: float | None) -> tuple[float | None, str]:
    kind = jax.devices()[0].device_kind
    if arg is not None:
        return arg * 1e12, f"{arg} TB/s (--hbm-tbs)"
    for name, tbs in KNOWN_TBS.items():
        if name in kind:
            return tbs * 1e12, f"{tbs} TB/s ({name}, measured)"
    return None, "unknown: pass --hbm-tbs to print the fraction"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU)")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--ops", type=lambda s: s.split(","), default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hbm-tbs", type=float, default=None, help="HBM bandwidth in TB/s")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)

    if args.small:
        shape = dict(B=1, K=2, G=2, D=64, hidden=256, window=8, dtype=jnp.float32)
        contexts = args.contexts or [512, 2048]
    else:
        shape = dict(B=1, K=8, G=4, D=128, hidden=4096, window=32, dtype=jnp.bfloat16)
        contexts = args.contexts or [8192, 32768, 131072]
    kernel = pallas.backend_pallas()
    impls = ["xla"] + ([kernel] if kernel else [])
    bw, bw_note = bandwidth(args.hbm_tbs)
    dev = jax.devices()[0]
    print(f"device: {dev.platform} {dev.device_kind} (jax {jax.__version__}); "
          f"HBM bandwidth: {bw_note}; implementations: {', '.join(impls)}"
          + ("" if kernel else " (no Pallas backend here: xla only)"))
    desc = ", ".join(f"{k}={jnp.dtype(v).name if k == 'dtype' else v}" for k, v in shape.items())
    print(f"shapes: {desc}; "
          f"median of {args.repeats} runs after a compile")
    header = (f"{'op':<17} {'context':>8} {'impl':<11} {'time ms':>10} {'MB':>9} "
              f"{'% HBM':>7} {'speedup':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for case in cases(contexts, **shape):
        if args.ops and case.op not in args.ops:
            continue
        base = None
        for impl in impls:
            fn, a = case.make(impl)
            try:
                t = timed(fn, a, args.repeats)
            except Exception as e:  # report and go on: one failing op must not hide the rest
                print(f"{case.op:<17} {case.context:>8} {impl:<11} failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]}", file=sys.stderr)
                continue
            base = t if impl == "xla" else base
            frac = case.bytes / t / bw if bw else None
            speed = base / t if (impl != "xla" and base) else None
            rows.append(dict(op=case.op, context=case.context, shape=case.shape, impl=impl,
                             time_s=t, bytes=case.bytes, hbm_fraction=frac, speedup=speed,
                             device=dev.device_kind))
            print(f"{case.op:<17} {case.context:>8} {impl:<11} {t * 1e3:>10.3f} "
                  f"{case.bytes / 1e6:>9.2f} {'' if frac is None else f'{100 * frac:.1f}':>7} "
                  f"{'' if speed is None else f'{speed:.2f}x':>8}")
            sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
