"""Memory bounded by the budget: the compressed cache's bytes and the process's peak memory
against the full cache, at a 32k context on CPU, measured in one run.

    python -m kvjax.bench.memory                                  # 32768 tokens, budget 1024
    python -m kvjax.bench.memory --context 8192 --methods snapkv  # quicker

A random-weight Llama-style model whose KV cache is most of what a long prefill holds (8
layers, one KV head of 64, fp32: 4 KiB of KV per token, 128 MiB at 32k) compresses one
random prompt with each method at `--budget` entries per layer and head, and with the full
cache. Each configuration runs in a child process of its own (a process's peak only
grows, so one process cannot measure two): the child compiles the prefill first, then
resets the kernel's peak-RSS counter (`/proc/self/clear_refs`), runs the prefill with
compression (`engine.run`, no decoding, no slot shrinking), and reports

- the cache's allocated and live bytes (`kv_bytes_allocated`, `kv_bytes_live`) against
  the full cache's (`kv_bytes_full`): what the budget bounds;
- the process's peak RSS during the run (`VmHWM`), and that peak above the RSS the
  process held just before it (`run_peak`: what the prefill itself took: the cache, one
  layer's uncompressed keys and values at a time while it is compressed, and the
  attention's per-block scores, which do not depend on the budget).

The ratios divide each method's figure by the full cache's from the same invocation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MiB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def model_config(a):
    from kvjax.config import ModelConfig

    return ModelConfig(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=a.layers, num_heads=a.kv_heads, num_kv_heads=a.kv_heads,
                       head_dim=a.head_dim, max_position_embeddings=a.context + 64,
                       bos_token_id=1, eos_token_ids=(2,))


def child(a) -> dict:
    """One configuration in this process: compile, reset the peak, measure."""
    import jax
    import numpy as np

    from kvjax import engine, methods
    from kvjax.engine import steps
    from kvjax.pallas import Kernels
    from kvjax.train import init_params

    cfg = model_config(a)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.05)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, a.context).tolist()
    method = methods.Method() if a.child == "full" else \
        methods.create(a.child).with_budget(a.budget)
    engine.check_request(cfg, [ids], None, method, 0)
    # the prefill program `engine.run` will call, compiled before the measurement (the
    # driver's own arguments: bucketed length, no question, no new tokens)
    T = engine.bucket(len(ids))
    tokens, valid = engine.pad_left([ids], T, cfg.pad_token_id)
    engine.compile_once(steps.prefill_extent, (params, tokens, valid), cfg=cfg, method=method,
                        capacity=method.decode_capacity(method.cache_slots(T, cfg), 0, 0),
                        kernels=Kernels(), mesh=None)
    reset = _reset_peak()
    before = _status("VmRSS")
    g = engine.run(params, cfg, [ids], method, max_new_tokens=0, shrink=False)
    peak = _status("VmHWM")
    st = g.stats
    return {"method": a.child, "alloc": st["kv_bytes_allocated"], "live": st["kv_bytes_live"],
            "full": st["kv_bytes_full"], "peak": peak, "run_peak": peak - before,
            "reset": reset, "compile_s": st["compile_s"], "ttft_s": st["ttft_s"]}


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--methods", default="snapkv,pyramidkv,streaming_llm")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0
    import jax

    cfg = model_config(a)
    print(f"random llama: {cfg.num_layers} layers, {cfg.num_kv_heads} KV head(s) of "
          f"{cfg.head_dim}, fp32; context {a.context}; budget {a.budget} per layer and head")
    print(f"{jax.devices()[0].platform}, jax {jax.__version__}; one child process a row")
    rows, given = [], sys.argv[1:] if argv is None else list(argv)
    for name in ["full", *[m for m in a.methods.split(",") if m]]:
        out = subprocess.run([sys.executable, "-m", "kvjax.bench.memory", *given, "--child",
                              name],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = rows[0]
    print(f"{'method':>13} {'alloc_MiB':>9} {'alloc/full':>10} {'live/full':>9} "
          f"{'peak_MiB':>8} {'peak/full':>9} {'run_MiB':>7} {'run/full':>8} {'ttft_s':>6}")
    for r in rows:
        print(f"{r['method']:>13} {r['alloc'] / MiB:9.1f} {r['alloc'] / full['alloc']:10.4f} "
              f"{r['live'] / full['live']:9.4f} {r['peak'] / MiB:8.0f} "
              f"{r['peak'] / full['peak']:9.3f} {r['run_peak'] / MiB:7.0f} "
              f"{r['run_peak'] / full['run_peak']:8.3f} {r['ttft_s']:6.1f}")
    print(f"full cache of the prompt: {full['full'] / MiB:.1f} MiB")
    notes = [r["method"] for r in rows if r["compile_s"] > 0 or not r["reset"]]
    if notes:
        print(f"note: {', '.join(notes)}: compiled during the measured run or the peak "
              "counter could not be reset; their peaks include compilation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
