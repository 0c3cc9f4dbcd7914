"""The GPU check: run it on every GPU you get; it writes docs/results/gpu.md.

    PYTHONPATH=. python3 -m kvjax.bench.gpu                  # one GPU, <= 9 minutes
    python -m kvjax.bench.gpu --small --out /tmp/gpu.md      # the same steps, tiny (CPU)

Steps (`--steps`), in this order, each given the time budget (`--budget-s`) less what the
later steps keep (`RESERVE_S`); what does not fit is listed as not run:
- methods: every registered method on a Llama-3.1-8B-shaped model (hidden 4096, 32/8
  heads, head dim 128, vocab 128256, `--layers` of its 32 layers, random bf16 weights) at
  each `--contexts` with the default kernels: runs or fails, TTFT and its ratio to full,
  time per output token against (weights + live KV) / bandwidth, process peak memory;
- roofline: prefill MFU and decode against the memory roofline on the whole 32-layer
  shape, batch 1 at each context and batch 8 at the smallest, for the full cache over
  per-layer buffers and over the layer scan, and SnapKV at 1/8 (`ROOFLINE_VARIANTS`): MFU = prefill
  FLOPs / TTFT / the bf16 matmul rate measured in this run; the bound = (weight bytes +
  live KV bytes) / the copy bandwidth measured in this run;
- profile: device time per op (jax.profiler) of a prefill and decode step for each
  `--profile-cases` (context x batch : decode layer loop [: method, default full]; default
  the largest context, batch 1); the device total against the wall time per token shows
  what a host loop (SlimInfer's offload) adds; the Perfetto traces land beside `--out`;
- kernels: `python -m kvjax.bench.kernels` (each kernel op against its xla reference);
- xla: `--xla-methods` again with every kernel xla (the comparison);
- tests: the fast tests on this backend (`pytest -m "not slow"` over `--tests`, in
  `--test-workers` processes); their whole output lands in tests.txt beside `--out`.
`--append` adds a run's rows to the `--out` file's, for a second run that finishes or
re-checks what the first could not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback
from functools import partial
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


def run_methods(model, names, contexts, kernels_choices, deadline, new_tokens, bytes_s):
    import tempfile

    import kvjax
    from kvjax import engine
    from kvjax.pallas import Kernels

    rows, rng = [], np.random.default_rng(0)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
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
                               compile_s=r.stats["compile_s"], kernels_used=r.stats["kernels"],
                               roofline=(weight_bytes + r.stats["kv_bytes_live"]) / bytes_s
                               / r.stats["tpot_s"])
                except Exception as e:  # a failure is a result here: it is reported
                    row.update(status=f"FAILED: {type(e).__name__}: {str(e)[:200]}")
                row["peak_gb"] = peak_gb()
                rows.append(row)
                engine.clear_compiled()
    return rows


# (method, decode layer loop) of each roofline case: the per-layer loop against the scan it
# replaces (full cache), and SnapKV at 1/8 of the context (`Kernels.decode_layers`); the
# per-layer loop runs on the model with its weights stored per layer (`Model.with_layers`:
# no per-generation copy of the weights), the scan on the stacked model
ROOFLINE_VARIANTS = (("full", "per_layer"), ("full", "scan"), ("snapkv", "per_layer"))


def _stored_for(model, layout: str):
    """The model as `layout` reads it without copying weights: per-layer buffers for the
    per-layer loop, the stacked arrays for the scan."""
    return model.with_layers("per_layer" if layout == "per_layer" else "stacked")


def roofline(model, cases, deadline, rates, variants=ROOFLINE_VARIANTS):
    """Prefill MFU and decode time vs the (weights + live KV) / bandwidth bound, for each
    (context, batch) in `cases` and each (method, decode layout) in `variants`."""
    import kvjax
    from kvjax.methods.slim.blocks import layer_flops
    from kvjax.models.transformer import layer_storage
    from kvjax.pallas import Kernels

    cfg, (flops_s, bytes_s) = model.cfg, rates
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    stored = {lay: _stored_for(model, lay) for _, lay in variants}  # one copy per storage
    rows, rng = [], np.random.default_rng(1)
    for n, batch in cases:
        ids = [[int(x) for x in rng.integers(3, cfg.vocab_size - 1, n)] for _ in range(batch)]
        for name, layout in variants:
            row = dict(context=n, batch=batch, method=name, layout=layout,
                       stored=layer_storage(stored[layout].params))
            if time.perf_counter() > deadline:
                rows.append(dict(row, status="not run (time budget)"))
                continue
            try:
                m = kvjax.methods.create(name)
                # 1/8 of the context (at least 64: the --small contexts are below SnapKV's
                # window of 32 x 8)
                m = m.with_budget(max(n // 8, 64)) if m.takes_budget() else m
                r = kvjax.generate(stored[layout], ids if batch > 1 else ids[0], method=m,
                                   max_new_tokens=16, kernels=Kernels(decode_layers=layout))
                flops = batch * cfg.num_layers * layer_flops(cfg, n, (n + 1) / 2)
                bound = (weight_bytes + r.stats["kv_bytes_live"]) / bytes_s
                rows.append(dict(row, status="ok", ttft_s=r.stats["ttft_s"],
                                 mfu=flops / r.stats["ttft_s"] / flops_s,
                                 tpot_s=r.stats["tpot_s"], bound_s=bound,
                                 roofline=bound / r.stats["tpot_s"],
                                 compile_s=r.stats["compile_s"]))
            except Exception as e:
                rows.append(dict(row, status=f"FAILED: {type(e).__name__}: {str(e)[:200]}"))
    return rows


def profile(model, n: int, out_dir: Path, batch: int = 1, layout: str = "auto",
            method: str = "full", unroll: int = 1) -> str:
    """Device time per op for `method` at `n` tokens x `batch` with the decode layer
    loop `layout` (`Kernels.decode_layers`) and `unroll` steps between two checks of the
    loop's stop condition (`Kernels.decode_unroll`): a prefill (1 new token) and a prefill + 32
    tokens, each traced with `jax.profiler` (Perfetto JSON under `out_dir`); the decode
    column is the difference of the two over 31 tokens (so a once-per-generation cost,
    such as splitting the cache into per-layer buffers, is in it divided by 31)."""
    import collections
    import gzip
    import shutil
    import tempfile

    import kvjax
    from kvjax.pallas import Kernels

    rng = np.random.default_rng(3)
    ids = [[int(x) for x in rng.integers(3, model.cfg.vocab_size - 1, n)] for _ in range(batch)]
    gen = partial(kvjax.generate, _stored_for(model, layout), ids if batch > 1 else ids[0],
                  method, kernels=Kernels(decode_layers=layout, decode_unroll=unroll))
    gen(max_new_tokens=32)  # compiles outside the traces
    totals, tag = {}, (f"{n}x{batch}_{layout}" + (f"_u{unroll}" if unroll > 1 else "")
                       + (f"_{method}" if method != "full" else ""))
    for label, new in (("prefill", 1), ("gen32", 32)):
        d = Path(tempfile.mkdtemp()) / label
        with jax.profiler.trace(str(d), create_perfetto_trace=True):
            r = gen(max_new_tokens=new)
        f = next(d.rglob("perfetto_trace.json.gz"))
        if f.stat().st_size < 15 * 2**20:
            shutil.copy(f, out_dir / f"trace_{tag}_{label}.json.gz")
        ev = json.load(gzip.open(f))
        ev = ev["traceEvents"] if isinstance(ev, dict) else ev
        procs = {e["pid"]: e["args"]["name"] for e in ev
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
        threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev
                   if e.get("ph") == "M" and e.get("name") == "thread_name"}
        ops, streams = collections.Counter(), collections.Counter()
        for e in ev:
            if e.get("ph") == "X" and "/device:" in procs.get(e.get("pid"), ""):
                line = threads.get((e["pid"], e.get("tid")), "")
                # "XLA Ops" holds each HLO op once; the stream lines hold the same kernels
                # again, so one of the two is counted (ops where the trace has them)
                for key, c in (("XLA Ops", ops), ("Stream", streams)):
                    if key in line:
                        c[e["name"][:70]] += e.get("dur", 0) / 1e3
        totals[label] = ops or streams
        if not totals[label]:
            return f"no device events in the trace (processes: {sorted(set(procs.values()))})"
    pre, g32 = totals["prefill"], totals["gen32"]
    lines = [f"{n} tokens x {batch}, {method}, "
             f"decode_layers {r.stats['kernels']['decode_layers']}, "
             f"decode_unroll {r.stats['kernels'].get('decode_unroll', '1')}, "
             f"tpot {r.stats['tpot_s'] * 1e3:.2f} ms (wall, 32 tokens)",
             f"{'op':70} {'prefill ms':>11} {'decode ms/tok':>14}"]
    for name, _ in (pre + g32).most_common(25):
        lines.append(f"{name:70} {pre[name]:11.2f} {(g32[name] - pre[name]) / 31:14.3f}")
    lines.append(f"{'total':70} {sum(pre.values()):11.2f} "
                 f"{(sum(g32.values()) - sum(pre.values())) / 31:14.3f}")
    return "\n".join(lines)


def run_tests(tests: str, workers: int, deadline: float, log: Path) -> str:
    """The fast tests on this backend; their whole output goes to `log` (failures named)."""
    left = int(deadline - time.perf_counter())
    if left < 30:
        return "not run (time budget)"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    xdist = ["-n", str(workers), "--dist", "loadfile"] if workers else []
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-v", "-m", "not slow",
                            "-p", "no:cacheprovider", *xdist, *tests.split(",")], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=left)
        log.write_text(p.stdout + p.stderr)
        return (p.stdout.strip().splitlines() or ["(no output)"])[-1].strip("= ")
    except subprocess.TimeoutExpired as e:
        log.write_text(str(e.stdout or "") + str(e.stderr or ""))
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
    """The commit measured: $KVJAX_COMMIT where set (a device copy's .git can be older
    than its working tree), else git's."""
    if os.environ.get("KVJAX_COMMIT"):
        return os.environ["KVJAX_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return (out or "unknown") + (" (uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def report(runs, rows, roof) -> str:
    """gpu.md from one or more runs (`--append`): each run's environment, then the tables."""
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    lines = ["# kvjax on a GPU", "", "Written by `python -m kvjax.bench.gpu`. Random weights of "
             "real shapes; TTFT and ms/token exclude compilation (`compile_s` in gpu.jsonl). "
             "% of bound = (weight bytes + live KV bytes) / the copy bandwidth measured in the "
             "same run, over the measured time per token.", ""]
    for i, env in enumerate(runs, 1):
        lines += [f"Run {i}: {env['device']}, jax {env['jax']}, backend {env['backend']}, "
                  f"commit {env['commit']}, {env['date']}; `{env['command']}`. Denominators "
                  f"measured in this run: bf16 matmul {env['tflops']:.3g} TFLOP/s, copy "
                  f"{env['tbs']:.3g} TB/s. Fast tests: {env['tests']}"
                  + (f". XLA_FLAGS: `{env['xla_flags']}`" if env.get("xla_flags") else ""), ""]
    full = {(r["run"], r["context"], r["kernels"]): r.get("ttft_s") for r in rows
            if r["method"] == "full"}
    lines += ["## Every method (random weights, `--layers` of the 8B shape)", "",
              "| run | context | kernels | method | status | TTFT s | TTFT / full | ms/token | "
              "% of bound | process peak GB so far |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = full.get((r["run"], r["context"], r["kernels"]))
        ratio = r["ttft_s"] / f if f and r.get("ttft_s") else None
        lines.append(f"| {r['run']} | {r['context']} | {r['kernels']} | {r['method']} | "
                     f"{r['status']} | {fmt(r.get('ttft_s'))} | {fmt(ratio, '{:.2f}x')} | "
                     f"{fmt(r.get('tpot_s') and r['tpot_s'] * 1e3, '{:.2f}')} | "
                     f"{fmt(r.get('roofline'), '{:.0%}')} | {fmt(r.get('peak_gb'), '{:.1f}')} |")
    lines += ["", "## Roofline (32-layer shape; decode layers: `Kernels.decode_layers`)", "",
              "| run | context | batch | method | decode layers | status | TTFT s | MFU | "
              "ms/token | bound ms/token | % of bound |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in roof:
        # rows of runs before the per-layer loop existed: the full cache over the scan
        lines.append(f"| {r['run']} | {r['context']} | {r.get('batch', 1)} | "
                     f"{r.get('method', 'full')} | {r.get('layout', 'scan')}"
                     # rows before 2026-11-29: the per-layer loop split a stacked model
                     f"{' (stored per layer)' if r.get('stored') == 'per_layer' else ''} | "
                     f"{r['status']} | "
                     f"{fmt(r.get('ttft_s'))} | {fmt(r.get('mfu'), '{:.1%}')} | "
                     f"{fmt(r.get('tpot_s') and r['tpot_s'] * 1e3, '{:.2f}')} | "
                     f"{fmt(r.get('bound_s') and r['bound_s'] * 1e3, '{:.2f}')} | "
                     f"{fmt(r.get('roofline'), '{:.0%}')} |")
    for i, env in enumerate(runs, 1):
        for key, title in (("kernels", "Kernels"), ("profile", "Profile")):
            if env.get(key):
                lines += ["", f"## {title} (run {i})", "", "```", env[key].strip(), "```"]
    return "\n".join(lines) + "\n"


STEPS = ("methods", "roofline", "profile", "kernels", "xla", "tests")
# seconds kept for each later step while an earlier one runs (what each took on an H100)
RESERVE_S = dict(methods=0, roofline=120, profile=60, kernels=40, xla=60, tests=45)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny shapes, short prompts (CPU)")
    p.add_argument("--budget-s", type=float, default=540.0, help="time budget, seconds")
    p.add_argument("--layers", type=int, default=4, help="layers of the every-method model")
    p.add_argument("--contexts", default=None, help="comma list (default 8192,32768)")
    p.add_argument("--methods", default=None, help="comma list (default: every method)")
    p.add_argument("--xla-methods", default="full,snapkv,h2o,tova,d2o",
                   help="methods also run with --kernels xla (the comparison)")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"comma list of steps, in this order: {','.join(STEPS)}")
    p.add_argument("--tests", default="tests/test_pallas.py,tests/test_engine.py,"
                   "tests/test_prompt_attention.py", help="comma list of test paths")
    p.add_argument("--test-workers", type=int, default=0,
                   help="pytest-xdist workers for the tests step (0: one process)")
    p.add_argument("--roofline-layers", type=int, default=32,
                   help="layers of the roofline and profile model (the 8B shape has 32)")
    p.add_argument("--roofline-cases", default=None,
                   help="CONTEXTxBATCH comma list (default: each context x1, the smallest x8)")
    p.add_argument("--profile-cases", default=None,
                   help="CONTEXTxBATCH:LAYOUT[/UNROLL][:METHOD] comma list for the profile "
                   "step (LAYOUT: a Kernels.decode_layers value; UNROLL: decode steps between "
                   "two checks of the stop condition, Kernels.decode_unroll, default 1; "
                   "METHOD: a registered method, default full; default: the largest "
                   "context x1:auto)")
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to those in the --out file's .jsonl")
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/gpu.md")
    a = p.parse_args(argv)
    from kvjax import engine, methods
    from kvjax.pallas.dispatch import DECODE_LAYERS

    steps = a.steps.split(",")
    if bad := [s for s in steps if s not in STEPS]:
        p.error(f"--steps: unknown {bad}; allowed: {','.join(STEPS)}")
    start = time.perf_counter()
    deadline = start + a.budget_s
    contexts = [int(x) for x in (a.contexts or ("512,1024" if a.small else "8192,32768"))
                .split(",")]
    names = a.methods.split(",") if a.methods else methods.names()
    rates = measured_rates(a.small)
    # the figures beside the page: JSON lines tagged run / row / roofline (not a records file)
    data = a.out.with_suffix(".jsonl")
    old = [json.loads(x) for x in data.read_text().splitlines()] if a.append else []
    runs, rows, roof = ([{k: v for k, v in x.items() if k != "kind"} for x in old
                         if x["kind"] == kind] for kind in ("run", "row", "roofline"))
    run = len(runs) + 1
    env = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
               backend=jax.default_backend(), commit=commit(),
               date=time.strftime("%Y-%m-%d"), command="python -m kvjax.bench.gpu "
               + " ".join(argv if argv is not None else sys.argv[1:]),
               tflops=rates[0] / 1e12, tbs=rates[1] / 1e12, tests="not run",
               xla_flags=os.environ.get("XLA_FLAGS", ""))
    runs.append(env)
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every step: a run stopped at its limit keeps what it measured
        a.out.write_text(report(runs, rows, roof))
        data.write_text("".join(json.dumps({"kind": kind, **x}, default=str) + "\n"
                                for kind, xs in (("run", runs), ("row", rows),
                                                 ("roofline", roof)) for x in xs))

    cases = ([tuple(int(v) for v in c.split("x")) for c in a.roofline_cases.split(",")]
             if a.roofline_cases else [(n, 1) for n in contexts] + [(min(contexts), 8)])
    profile_cases = []
    for c in (a.profile_cases or f"{max(contexts)}x1:auto").split(","):
        m = re.fullmatch(r"(\d+)x(\d+):(\w+)(?:/(\d+))?(?::(\w+))?", c)
        if (not m or m[3] not in DECODE_LAYERS or (m[4] and int(m[4]) < 1)
                or (m[5] and m[5] not in methods.names())):
            p.error(f"--profile-cases: {c!r} is not CONTEXTxBATCH:LAYOUT[/UNROLL][:METHOD] with "
                    f"LAYOUT one of {DECODE_LAYERS}, UNROLL an int >= 1 and METHOD a registered "
                    "method (python -m kvjax.run --list-methods)")
        profile_cases.append(((int(m[1]), int(m[2])), m[3], int(m[4] or 1), m[5] or "full"))
    models: dict = {}  # one random model per depth for the run (an 8B init takes seconds)

    def model_of(layers: int):
        if layers not in models:
            models[layers] = random_model(shape_8b(layers, a.small, max(contexts) + 64),
                                          jnp.bfloat16)
        return models[layers]

    for i, step in enumerate(steps):
        until = deadline - sum(RESERVE_S[s] for s in steps[i + 1:])
        print(f"[{time.perf_counter() - start:5.0f} s] {step}", file=sys.stderr, flush=True)
        if step in ("roofline", "profile"):
            model = model_of(a.roofline_layers)
            if step == "roofline":
                roof += [dict(r, run=run) for r in roofline(model, cases, until, rates)]
            else:
                parts = []
                for (n, batch), layout, unroll, meth in profile_cases:
                    if time.perf_counter() > until - 30:
                        parts.append(f"{n} tokens x {batch}, {meth}, {layout}: not run "
                                     "(time budget)")
                        continue
                    try:
                        parts.append(profile(model, n, a.out.parent, batch, layout, meth,
                                             unroll))
                    except Exception:
                        parts.append(traceback.format_exc(limit=4))
                    print(parts[-1], file=sys.stderr, flush=True)  # kept if the run is cut
                    engine.clear_compiled()
                env["profile"] = "\n\n".join(parts)
            engine.clear_compiled()
        elif step in ("methods", "xla"):
            which = (names, "auto") if step == "methods" else (a.xla_methods.split(","), "xla")
            rows += [dict(r, run=run) for r in run_methods(
                model_of(a.layers), which[0], contexts, (which[1],), until, 8, rates[1])]
        elif step == "kernels" and time.perf_counter() < until - 20:
            env["kernels"] = kernel_bench(a.small, contexts)
        elif step == "tests":
            env["tests"] = run_tests(a.tests, a.test_workers, deadline,
                                     a.out.parent / "tests.txt")
        later = set(steps[i + 1:])  # free the models no later step uses (device memory)
        need = ({a.roofline_layers} if later & {"roofline", "profile"} else set()) | (
            {a.layers} if later & {"methods", "xla"} else set())
        for k in set(models) - need:
            del models[k]
        save()
    save()
    print(f"wrote {a.out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
