"""The GPU check: run it on every GPU you get; it writes docs/results/gpu.md.

    PYTHONPATH=. python3 -m kvjax.bench.gpu                  # one GPU, <= 9 minutes
    python -m kvjax.bench.gpu --small --out /tmp/gpu.md      # the same steps, tiny (CPU)

Steps, each stopped when the time budget (`--budget-s`) is spent, the rest listed as not
run:
1. the fast tests on this backend (`pytest -m "not slow"` over `--tests`);
2. every registered method on a Llama-3.1-8B-shaped model (hidden 4096, 32/8 heads, head
   dim 128, vocab 128256, `--layers` of its 32 layers, random bf16 weights) at each
   `--contexts`, with the default kernels and with `--kernels xla`: runs or fails, TTFT,
   time per output token, peak device memory;
3. `python -m kvjax.bench.kernels` (each kernel op against its xla reference);
4. prefill MFU and decode against the memory roofline for the full cache on the whole
   32-layer shape: MFU = prefill FLOPs / TTFT / the bf16 matmul rate measured in this
   run; the bound = (weight bytes + live KV bytes) / the copy bandwidth measured in this
   run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def shape_8b(layers: int, small: bool, max_positions: int):
    """The model config of the check (tiny with `small`)."""
    from kvjax.config import ModelConfig

    if small:
        return ModelConfig(family="llama", vocab_size=512, hidden_size=128,
                           intermediate_size=256, num_layers=layers, num_heads=4,
                           num_kv_heads=2, head_dim=32, max_position_embeddings=max_positions,
                           bos_token_id=1, eos_token_ids=(2,))
    return ModelConfig(family="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=layers, num_heads=32,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=max_positions,
                       rope_theta=500000.0, bos_token_id=1, eos_token_ids=(2,))


def random_model(cfg, dtype):
    import kvjax
    from kvjax.train import init_params

    params = jax.tree.map(lambda x: x.astype(dtype),
                          init_params(cfg, jax.random.PRNGKey(0), std=0.02))
    return kvjax.Model(cfg, params, f"random-{cfg.num_layers}L")


def peak_gb() -> float | None:
    try:
        return jax.devices()[0].memory_stats()["peak_bytes_in_use"] / 2**30
    except Exception:  # CPU: no memory stats
        return None


def measured_rates(small: bool) -> tuple[float, float]:
    """(bf16 matmul FLOP/s, device copy bytes/s) measured here: the denominators."""
    n = 512 if small else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        out = mm(a)
    out.block_until_ready()
    flops = 10 * 2 * n**3 / (time.perf_counter() - t0)
    x = jnp.ones((64 if small else 1024) * 2**20 // 2, jnp.bfloat16)
    cp = jax.jit(lambda y: y + 1)
    cp(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        out = cp(x)
    out.block_until_ready()
    return flops, 10 * 2 * x.nbytes / (time.perf_counter() - t0)


def with_head_scores(method, path: str):
    """`method` (or the method it wraps) reading HeadKV's head scores from `path`."""
    import dataclasses

    if hasattr(method, "head_scores"):
        return dataclasses.replace(method, head_scores=path)
    if hasattr(method, "base"):
        return dataclasses.replace(method, base=with_head_scores(method.base, path))
    return method


def random_head_scores(cfg, path: Path) -> str:
    """HeadKV's per-head scores for the random model: random, as its weights are (HeadKV
    needs a file recorded for the model's config; what the check measures is speed)."""
    scores = np.random.default_rng(2).random((cfg.num_layers, cfg.num_heads))
    path.write_text(json.dumps({"config": cfg.to_hf(), "head_scores": scores.tolist(),
                                "note": "random scores for the random-weight GPU check"}))
    return str(path)


def run_methods(model, names, contexts, kernels_choices, deadline, new_tokens):
    import tempfile

    import kvjax
    from kvjax import engine
    from kvjax.pallas import Kernels

    rows, rng = [], np.random.default_rng(0)
    scores = random_head_scores(model.cfg, Path(tempfile.mkdtemp()) / "head_scores.json")
    for n in contexts:
        ids = [int(x) for x in rng.integers(3, model.cfg.vocab_size - 1, n)]
        budget = max(256, n // 32)  # 1024 at 32k, as the probe that found the crash
        for kind in kernels_choices:
            for name in names:
                row = dict(context=n, kernels=kind, method=name)
                if time.perf_counter() > deadline:
                    rows.append({**row, "status": "not run (time budget)"})
                    continue
                try:
                    m = with_head_scores(kvjax.methods.create(name).with_budget(budget),
                                         scores)
                    t0 = time.perf_counter()
                    r = kvjax.generate(model, ids, method=m, max_new_tokens=new_tokens,
                                       kernels=Kernels.every(kind))
                    row.update(status="ok", wall_s=time.perf_counter() - t0,
                               ttft_s=r.stats["ttft_s"], tpot_s=r.stats["tpot_s"],
                               compile_s=r.stats["compile_s"], kernels_used=r.stats["kernels"])
                except Exception as e:  # a failure is a result here: it is reported
                    row.update(status=f"FAILED: {type(e).__name__}: {str(e)[:200]}")
                row["peak_gb"] = peak_gb()
                rows.append(row)
                engine.clear_compiled()
    return rows


def roofline(cfg_full, contexts, deadline, small, rates):
    """Full-cache prefill MFU and decode time vs the (weights + KV) / bandwidth bound."""
    import kvjax
    from kvjax.methods.slim.blocks import layer_flops

    flops_s, bytes_s = rates
    model = random_model(cfg_full, jnp.bfloat16)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    rows, rng = [], np.random.default_rng(1)
    for n in contexts:
        if time.perf_counter() > deadline:
            rows.append(dict(context=n, status="not run (time budget)"))
            continue
        ids = [int(x) for x in rng.integers(3, cfg_full.vocab_size - 1, n)]
        try:
            r = kvjax.generate(model, ids, max_new_tokens=16)
            flops = cfg_full.num_layers * layer_flops(cfg_full, n, (n + 1) / 2)
            bound = (weight_bytes + r.stats["kv_bytes_live"]) / bytes_s
            rows.append(dict(context=n, status="ok", ttft_s=r.stats["ttft_s"],
                             mfu=flops / r.stats["ttft_s"] / flops_s,
                             tpot_s=r.stats["tpot_s"], bound_s=bound,
                             roofline=bound / r.stats["tpot_s"]))
        except Exception as e:
            rows.append(dict(context=n, status=f"FAILED: {type(e).__name__}: {str(e)[:200]}"))
    return rows


def run_tests(tests: str, deadline: float) -> str:
    left = int(deadline - time.perf_counter())
    if left < 30:
        return "not run (time budget)"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow",
                            "-p", "no:cacheprovider", *tests.split(",")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=left)
        return (p.stdout.strip().splitlines() or ["(no output)"])[-1]
    except subprocess.TimeoutExpired:
        return "stopped (time budget)"


def kernel_bench(small: bool, contexts) -> str:
    from kvjax.bench import kernels

    buf = io.StringIO()
    args = ["--small"] if small else ["--contexts", ",".join(map(str, contexts))]
    try:
        with contextlib.redirect_stdout(buf):
            kernels.main(args + ["--repeats", "3"])
    except Exception:
        buf.write(traceback.format_exc(limit=3))
    return buf.getvalue()


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return (out or "unknown") + (" (uncommitted changes)" if dirty else "")
    except OSError:
        return os.environ.get("KVJAX_COMMIT", "unknown")


def report(env, tests, rows, kernels_out, roof) -> str:
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    lines = ["# kvjax on a GPU", "",
             f"Device {env['device']}, jax {env['jax']}, backend {env['backend']}, commit "
             f"{env['commit']}, {env['date']}; `{env['command']}`. Denominators measured in "
             f"this run: bf16 matmul {env['tflops']:.3g} TFLOP/s, copy "
             f"{env['tbs']:.3g} TB/s.", "", f"Fast tests: {tests}", "",
             "## Every method (random weights)", "",
             "| context | kernels | method | status | TTFT s | ms/token | peak GB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['kernels']} | {r['method']} | {r['status']} | "
                     f"{fmt(r.get('ttft_s'))} | {fmt((r.get('tpot_s') or 0) * 1e3, '{:.2f}')} | "
                     f"{fmt(r.get('peak_gb'), '{:.1f}')} |")
    lines += ["", "## Kernels", "", "```", kernels_out.strip(), "```", "",
              "## Roofline (full cache, 32-layer shape)", "",
              "| context | status | TTFT s | MFU | ms/token | bound ms/token | % of bound |",
              "|---|---|---|---|---|---|---|"]
    for r in roof:
        lines.append(f"| {r['context']} | {r['status']} | {fmt(r.get('ttft_s'))} | "
                     f"{fmt(r.get('mfu'), '{:.1%}')} | "
                     f"{fmt((r.get('tpot_s') or 0) * 1e3, '{:.2f}')} | "
                     f"{fmt((r.get('bound_s') or 0) * 1e3, '{:.2f}')} | "
                     f"{fmt(r.get('roofline'), '{:.0%}')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes, short prompts (CPU)")
    p.add_argument("--budget-s", type=float, default=540.0, help="time budget, seconds")
    p.add_argument("--layers", type=int, default=4, help="layers of the every-method model")
    p.add_argument("--contexts", default=None, help="comma list (default 8192,32768)")
    p.add_argument("--methods", default=None, help="comma list (default: every method)")
    p.add_argument("--tests", default="tests/test_pallas.py,tests/test_engine.py,"
                   "tests/test_prompt_attention.py")
    p.add_argument("--no-tests", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/gpu.md")
    a = p.parse_args(argv)
    from kvjax import methods

    start = time.perf_counter()
    deadline = start + a.budget_s
    contexts = [int(x) for x in (a.contexts or ("512,1024" if a.small else "8192,32768"))
                .split(",")]
    names = a.methods.split(",") if a.methods else methods.names()
    rates = measured_rates(a.small)
    env = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
               backend=jax.default_backend(), commit=commit(),
               date=time.strftime("%Y-%m-%d"), command="python -m kvjax.bench.gpu "
               + " ".join(argv if argv is not None else sys.argv[1:]),
               tflops=rates[0] / 1e12, tbs=rates[1] / 1e12)
    tests = "not run (--no-tests)" if a.no_tests else run_tests(a.tests, deadline)
    cfg = shape_8b(a.layers, a.small, max(contexts) + 64)
    rows = run_methods(random_model(cfg, jnp.bfloat16), names, contexts, ("auto", "xla"),
                       deadline - 0.25 * a.budget_s, 8)
    kernels_out = kernel_bench(a.small, contexts)
    roof = roofline(shape_8b(4 if a.small else 32, a.small, max(contexts) + 64), contexts,
                    deadline, a.small, rates)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(report(env, tests, rows, kernels_out, roof))
    a.out.with_suffix(".json").write_text(json.dumps(dict(env=env, tests=tests, rows=rows,
                                                          roofline=roof), indent=1,
                                                     default=str))
    print(f"wrote {a.out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
