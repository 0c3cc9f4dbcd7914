"""Decode's weight layout on a GPU: one `lax.scan` over stacked [L, ...] weights and cache
against a Python loop over per-layer arrays, on one decoder step of the 8B shape.

    PYTHONPATH=. python3 -m kvjax.bench.decode_layout            # GPU, ~1 minute
    python -m kvjax.bench.decode_layout --small                   # tiny shapes (CPU)

Why: docs/results/gpu_targets.md found the full-cache decode step at 29% of its memory
bound, most of the rest spent copying each layer's slice of the stacked weights (and K)
before the gemms read it. This measures what a per-layer layout would gain before the
engine is rebuilt around it, and whether the per-layer loop needs per-layer buffers at all:
the same loop over static slices of the stacked arrays, alone and inside a `fori_loop`
(decode's while loop), where XLA may slice in place, copy every step, or hoist the copies. The step is a Llama layer stripped to its memory traffic:
q/k/v/o projections, grouped-query attention over a read-only cache of `context` rows,
the SwiGLU MLP (no norms, RoPE or cache write). % of bound = (weight + cache bytes) / the
copy bandwidth measured in the same run, over the measured step time.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from kvjax.bench.gpu import measured_rates


def _layer(x_BH, w, k_BKCD, v_BKCD):
    """One layer's decode step: its weights `w` = (wq, wk, wv, wo, gate, up, down)."""
    wq, wk, wv, wo, gate, up, down = w
    B, K, _, D = k_BKCD.shape
    q_BKGD = (x_BH @ wq).reshape(B, K, -1, D)
    s_BKGC = jnp.einsum("bkgd,bkcd->bkgc", q_BKGD, k_BKCD,
                        preferred_element_type=jnp.float32) / D**0.5
    p_BKGC = jax.nn.softmax(s_BKGC, axis=-1).astype(x_BH.dtype)
    o_BH = jnp.einsum("bkgc,bkcd->bkgd", p_BKGC, v_BKCD).reshape(B, -1)
    # k and v of the new token are computed (their bytes are read) but not written
    x_BH = x_BH + o_BH @ wo + 0 * ((x_BH @ wk).sum() + (x_BH @ wv).sum()).astype(x_BH.dtype)
    return x_BH + (jax.nn.silu(x_BH @ gate) * (x_BH @ up)) @ down


@jax.jit
def step_scan(x_BH, w_L, k_LBKCD, v_LBKCD):
    return jax.lax.scan(lambda x, xs: (_layer(x, *xs), None), x_BH,
                        (w_L, k_LBKCD, v_LBKCD))[0]


@jax.jit
def step_unrolled(x_BH, ws, ks, vs):
    for w, k, v in zip(ws, ks, vs):
        x_BH = _layer(x_BH, w, k, v)
    return x_BH


def _static(x_BH, w_L, k_LBKCD, v_LBKCD):
    """The unrolled loop over the stacked arrays, each layer a static slice: no per-layer
    copy made ahead of the step (what the engine's per-layer loop now splits once per
    generation, holding a second copy of the weights and cache: docs/results/speed.md)."""
    for i in range(k_LBKCD.shape[0]):
        x_BH = _layer(x_BH, tuple(w[i] for w in w_L), k_LBKCD[i], v_LBKCD[i])
    return x_BH


step_static = jax.jit(_static)
STEPS_IN_LOOP = 8


@jax.jit
def steps_static(x_BH, w_L, k_LBKCD, v_LBKCD):
    """STEPS_IN_LOOP steps of `_static` in one `fori_loop`, as decode runs them: whether
    XLA slices in place, copies every step, or hoists the slices out of the loop."""
    return jax.lax.fori_loop(0, STEPS_IN_LOOP,
                             lambda _, x: _static(x, w_L, k_LBKCD, v_LBKCD), x_BH)


@jax.jit
def steps_unrolled(x_BH, ws, ks, vs):
    return jax.lax.fori_loop(0, STEPS_IN_LOOP, lambda _, x: step_unrolled(x, ws, ks, vs), x_BH)


def _time(f, *args, repeats: int = 20) -> float:
    f(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = f(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / repeats


def case(layers, hidden, inter, heads, kv_heads, head_dim, context, batch, bw):
    """Both layouts on one shape: a dict of ms/step and % of bound."""
    dt = jnp.bfloat16
    shapes = [(hidden, heads * head_dim), (hidden, kv_heads * head_dim),
              (hidden, kv_heads * head_dim), (heads * head_dim, hidden), (hidden, inter),
              (hidden, inter), (inter, hidden)]
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    cache = (layers, batch, kv_heads, context, head_dim)
    x = jax.random.normal(next(keys), (batch, hidden), dt)
    w_L = tuple(0.02 * jax.random.normal(next(keys), (layers, *s), dt) for s in shapes)
    k_L, v_L = (jax.random.normal(next(keys), cache, dt) for _ in range(2))
    nbytes = sum(a.nbytes for a in (*w_L, k_L, v_L))
    out = dict(context=context, batch=batch, bound_ms=1e3 * nbytes / bw)
    out["scan_ms"] = 1e3 * _time(step_scan, x, w_L, k_L, v_L)
    out["static_ms"] = 1e3 * _time(step_static, x, w_L, k_L, v_L)
    out["static_loop_ms"] = 1e3 * _time(steps_static, x, w_L, k_L, v_L) / STEPS_IN_LOOP
    # per-layer buffers: split, then free the stacked copies (device memory)
    ws = [tuple(w[i] for w in w_L) for i in range(layers)]
    ks, vs = [k_L[i] for i in range(layers)], [v_L[i] for i in range(layers)]
    jax.block_until_ready((ws, ks, vs))
    del w_L, k_L, v_L
    out["unrolled_ms"] = 1e3 * _time(step_unrolled, x, ws, ks, vs)
    out["unrolled_loop_ms"] = 1e3 * _time(steps_unrolled, x, ws, ks, vs) / STEPS_IN_LOOP
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.decode_layout",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU)")
    p.add_argument("--cases", default="32768x1,8192x8", help="CONTEXTxBATCH comma list")
    a = p.parse_args(argv)
    shape = (4, 128, 256, 4, 2, 32) if a.small else (32, 4096, 14336, 32, 8, 128)
    cases = ["512x1,256x4"] if a.small else a.cases.split(",")
    bw = measured_rates(a.small)[1]
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"copy {bw / 1e12:.2f} TB/s; layers, hidden, inter, heads, kv, d = {shape}")
    # scan / unrolled: one step; static: unrolled over static slices of the stacked arrays;
    # "in a loop": the step's time inside a fori_loop of STEPS_IN_LOOP steps
    cols = ("scan", "unrolled", "unrolled_loop", "static", "static_loop")
    print(f"ms a step (% of bound); in a loop = {STEPS_IN_LOOP} steps in one fori_loop")
    print("| context | batch | bound ms | scan | per-layer buffers | the same, in a loop | "
          "static slices | the same, in a loop |")
    print("|---" * (3 + len(cols)) + "|")
    for c in ",".join(cases).split(","):
        n, b = (int(v) for v in c.split("x"))
        r = case(*shape, n, b, bw)
        cells = " | ".join(f"{r[k + '_ms']:.2f} ({100 * r['bound_ms'] / r[k + '_ms']:.0f}%)"
                           for k in cols)
        print(f"| {n} | {b} | {r['bound_ms']:.2f} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
