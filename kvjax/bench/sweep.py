"""Sweep throughput on this machine, one run: a shared-prefill sweep against the same grid
run method by method, and kvjax's CPU prefill against PyTorch's.

    python -m kvjax.bench.sweep                      # smollm2-135m if installed, else tiny-retrieval
    python -m kvjax.bench.sweep --samples 16 --contexts 2048,4096

Part 1, the sweep: `python -m kvjax.run` on one task at one context, `--method` at one
budget (1/8 of the context), `--samples` samples in batches of `--batch-size`, three ways:
  shared     every method, the full prefill of each batch run once for all of them
             (docs/design.md, "Shared prefill");
  separate   the same, each method with its own prefill (`--no-share-prefill`);
  first      the first method alone.
Printed: wall time of each (model loading and compilation included: that is what a sweep
costs), programs compiled, `shared / first` (the issue's target: 5 methods at most 1.8x one
method) and the minutes one 50-sample cell costs inside the shared sweep. The records of
`shared` and `separate` are checked equal (predictions and accuracy).

Part 2, the prefill: the full prefill (and SnapKV's prefill + compression) of one prompt at
each `--contexts` length, kvjax's compiled program against transformers' Llama (SDPA,
float32, as many threads as jax uses) of the same shape, and both as GFLOP/s against a
plain `jnp.dot` of the MLP's shape ([T, hidden] x [hidden, intermediate]) on this machine.
The three run in turn, `--repeats` rounds: times are each one's best, the ratio is the
median over the rounds of kvjax / torch within a round.
FLOPs: 2 per weight per token for the layers, and 4 T^2/2 H Dh per layer for the causal
attention (the work a causal kernel does).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np


def _compiles():
    """A counter of XLA backend compilations (every program the run compiled)."""
    from jax import monitoring

    seen = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: seen.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    return seen


def sweep(argv: list[str], out: Path, seen: list) -> tuple[float, int, list[dict]]:
    from kvjax import engine
    from kvjax import run as cli

    engine.clear_compiled()
    n0, t0 = len(seen), time.perf_counter()
    rc = cli.main([*argv, "--output", str(out), "--no-progress"])
    if rc:
        raise SystemExit(f"python -m kvjax.run {' '.join(argv)} failed ({rc})")
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    return time.perf_counter() - t0, len(seen) - n0, recs


def part_sweep(a, seen) -> None:
    ctx, methods = a.sweep_context, a.methods.split(",")
    budget = ctx // 8
    base = ["--model", a.model, "--task", a.task, "--context", str(ctx), "--samples",
            str(a.samples), "--batch-size", str(a.batch_size), "--budget", str(budget),
            "--details"]
    print(f"[1] sweep: {a.task} at {ctx}, budget {budget} (1/8), {a.samples} samples, batch "
          f"{a.batch_size}, methods {','.join(methods)}")
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for name, extra in (("shared", ["--method", a.methods]),
                            ("separate", ["--method", a.methods, "--no-share-prefill"]),
                            ("first", ["--method", methods[0]])):
            rows[name] = sweep(base + extra, Path(d) / f"{name}.jsonl", seen)
    same = all([x["prediction"] for x in r["details"]] == [x["prediction"] for x in s["details"]]
               for r, s in zip(rows["shared"][2], rows["separate"][2]))
    print(f"  {'run':>9} {'wall_s':>8} {'compiles':>8} {'records':>7}")
    for name, (wall, n, recs) in rows.items():
        print(f"  {name:>9} {wall:8.1f} {n:8d} {len(recs):7d}")
    sh, sep, one = (rows[k][0] for k in ("shared", "separate", "first"))
    cell = sh / len(methods) * 50 / a.samples / 60
    print(f"  shared / first {sh / one:.2f}x (target <= 1.8x for 5 methods)   shared / "
          f"separate {sh / sep:.2f}x   one 50-sample cell inside the shared sweep: "
          f"{cell:.1f} min (target < 3)   shared records equal separate: {same}")


def _flops(cfg, T: int) -> float:
    per_token = 2 * cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + 2 * cfg.num_heads * cfg.head_dim * cfg.hidden_size \
        + 2 * 3 * cfg.hidden_size * cfg.intermediate_size
    attn = 4 * (T * T / 2) * cfg.num_heads * cfg.head_dim
    return cfg.num_layers * (T * per_token + attn)


def _best(f, repeats: int) -> float:
    f()  # warm
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def part_prefill(a, model) -> None:
    import jax.numpy as jnp
    import torch
    import transformers

    from kvjax import engine, methods

    cfg = model.cfg
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM._from_config(hc, attn_implementation="sdpa",
                                                    dtype=torch.float32).eval()
    print(f"\n[2] prefill of one prompt: kvjax (jax {jax.__version__}, {jax.default_backend()}) "
          f"vs transformers {transformers.__version__} (torch {torch.__version__}, SDPA, "
          f"float32, {torch.get_num_threads()} threads); {a.repeats} rounds of one run each, "
          "times the best round, ratio the median of the rounds' ratios")
    print(f"  {'context':>7} {'what':>16} {'kvjax_s':>8} {'torch_s':>8} {'ratio':>6} "
          f"{'rounds':>10} {'kvjax_GF/s':>10} {'torch_GF/s':>10} {'dot_GF/s':>8}")
    snap = methods.create("snapkv")
    for T in a.contexts:
        ids = np.random.default_rng(T).integers(5, cfg.vocab_size, T).tolist()
        x = torch.tensor([ids])
        w1 = jnp.ones((cfg.hidden_size, cfg.intermediate_size), jnp.float32)
        h = jnp.ones((T, cfg.hidden_size), jnp.float32)
        dot = jax.jit(jnp.dot)
        t_dot = _best(lambda: dot(h, w1).block_until_ready(), a.repeats)
        dot_gf = 2 * T * cfg.hidden_size * cfg.intermediate_size / t_dot / 1e9
        fl = _flops(cfg, T)

        def torch_run():
            with torch.no_grad():
                hf.model(x)

        runs = {"torch": torch_run}
        for what, m in (("full", None), ("snapkv+compress", snap.with_budget(T // 8))):
            runs[what] = lambda m=m: engine.run(model.params, cfg, [ids], m,  # noqa: E731
                                                max_new_tokens=0).stats["ttft_s"]
        # rounds of one run each, in turn: this machine's speed drifts by 10-15% over
        # minutes, and a drift then lands on torch and kvjax alike (the ratio is the median
        # of the rounds' ratios)
        for f in runs.values():
            f()  # compiles, warms
        times = {w: [] for w in runs}
        for _ in range(a.repeats):
            for w, f in runs.items():  # kvjax: the engine's own TTFT clock (prefill only)
                t0 = time.perf_counter()
                t = f()
                times[w].append(time.perf_counter() - t0 if t is None else t)
        t_torch = min(times["torch"])
        for what in ("full", "snapkv+compress"):
            t = min(times[what])
            rounds = np.array(times[what]) / np.array(times["torch"])
            span = f"{rounds.min():.2f}-{rounds.max():.2f}"
            print(f"  {T:7d} {what:>16} {t:8.3f} {t_torch:8.3f} {np.median(rounds):6.2f} "
                  f"{span:>10} "
                  f"{fl / t / 1e9:10.1f} {fl / t_torch / 1e9:10.1f} {dot_gf:8.1f}")


def main(argv=None) -> int:
    import kvjax
    from kvjax.api import packaged_file

    p = argparse.ArgumentParser(prog="python -m kvjax.bench.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="default: smollm2-135m when installed, else tiny-retrieval")
    p.add_argument("--method", dest="methods",
                   default="snapkv,ada_snapkv,pyramidkv,tova,streaming_llm",
                   help="comma-separated methods, as kvjax.run's --method")
    p.add_argument("--task", default="niah_single")
    p.add_argument("--sweep-context", type=int, default=2048)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--contexts", default="2048,4096", help="part 2's prompt lengths")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip", choices=("sweep", "prefill"), action="append", default=[])
    a = p.parse_args(argv)
    a.contexts = [int(c) for c in a.contexts.split(",")]
    if a.model is None:
        try:
            packaged_file("smollm2-135m")
            a.model = "smollm2-135m"
        except (OSError, ValueError):
            a.model = "tiny-retrieval"
    seen = _compiles()
    model = kvjax.load(a.model)
    print(f"model={a.model} layers={model.cfg.num_layers} hidden={model.cfg.hidden_size} "
          f"| jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} cpus")
    if "sweep" not in a.skip:
        part_sweep(a, seen)
    if "prefill" not in a.skip:
        part_prefill(a, model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
