"""Decode speed and prefill+compress time: kvjax vs HF transformers + kvpress, one run.

    python -m kvjax.bench.decode                      # bundled model (or `random` if absent)
    python -m kvjax.bench.decode --model random --context 2048 --budget 256

Part 1 (same model, same prompt, same budget, same machine): SnapKV configured alike on
both sides (window 32, avg pooling kernel 5, GQA mean -- the pooling kvpress has) keeps
`--budget` entries per (layer, KV head); kvpress's `compression_ratio` is set so that
`int(n (1 - r)) = budget`. kvjax runs `engine.run` (compiled once before the timed
run; compile time printed apart); PyTorch runs `with press(model): model.model(context)`
then a greedy loop of `model(token, past_key_values=cache)` calls. Printed: prefill +
compress time (the logits of the last prompt token included), decode tokens/s, and the
ratios kvjax / torch.

Part 2 (kvjax only): decode time per token with the compressed cache vs the full cache,
at each `--decode-contexts` length (2048 and 8192 by default).

Part 3 (kvjax only): decode's layer loop (`Kernels.decode_layers`), one `lax.scan` over
the stacked layers vs a loop over per-layer buffers, for the full cache and SnapKV at each
`--decode-contexts` length: compile seconds (every program of the run), ms/token, the
ratios, and whether the greedy tokens are equal.

    python -m kvjax.bench.decode --model smollm2-135m --parts 3 --decode-contexts 2048

Every figure is measured in the run that prints it: one timed run each (`--repeats` for
medians).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np


def load_model(name: str, max_context: int):
    from kvjax import api
    from kvjax.bench.prefill import model_for

    if name == "tiny-retrieval" and not (api.BUNDLED_DIR / name / "config.json").exists():
        print("bundled model tiny-retrieval is not in this checkout: using `random` (its "
              "architecture, random weights)")
        name = "random"
    model = model_for(name, max_context)
    if model.cfg.max_position_embeddings < max_context:
        model.cfg = dataclasses.replace(model.cfg, max_position_embeddings=max_context)
    return model


def kvjax_run(model, ids, method, new_tokens, repeats, kernels=None):
    from kvjax import engine
    from kvjax.pallas.dispatch import Kernels

    runs = [engine.run(model.params, model.cfg, [ids], method, max_new_tokens=new_tokens,
                       stop_ids=(), kernels=kernels or Kernels())
            for _ in range(repeats + 1)]  # the first compiles
    ttft = statistics.median(r.stats["ttft_s"] for r in runs[1:])
    tpot = statistics.median(r.stats["tpot_s"] for r in runs[1:])
    return runs[0].stats["compile_s"], ttft, tpot, runs[-1].tokens[0], runs[-1].stats


def torch_run(hf, press, ids, new_tokens, repeats):
    import torch
    from transformers import DynamicCache

    n = len(ids)
    x = torch.tensor([ids])
    out = []
    for _ in range(repeats + 1):  # the first warms up
        with torch.no_grad():
            t0 = time.perf_counter()
            cache = DynamicCache()
            ctx = press(hf) if press is not None else _null()
            with ctx:
                h = hf.model(input_ids=x, past_key_values=cache).last_hidden_state
            logits = hf.lm_head(h[:, -1])
            t1 = time.perf_counter()
            toks = []
            for i in range(new_tokens):
                tok = logits.argmax(-1)
                toks.append(int(tok))
                logits = hf(input_ids=tok[:, None], past_key_values=cache,
                            position_ids=torch.tensor([[n + i]])).logits[:, -1]
            t2 = time.perf_counter()
        out.append((t1 - t0, (t2 - t1) / new_tokens, toks, cache.get_seq_length()))
    rest = out[1:]
    return (statistics.median(r[0] for r in rest), statistics.median(r[1] for r in rest),
            rest[-1][2], rest[-1][3])


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None) -> int:
    from kvjax import methods

    p = argparse.ArgumentParser(prog="python -m kvjax.bench.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-retrieval",
                   help="bundled model, checkpoint directory, or `random`")
    p.add_argument("--context", type=int, default=2048, help="prompt length for part 1")
    p.add_argument("--budget", type=int, default=256, help="KV entries per (layer, KV head)")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-contexts", default="2048,8192")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--parts", default="1,2,3", help="which parts to run (1, 2, 3)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (on a shared 2-core machine 2 threads ran the "
                        "HF prefill ~25x slower than 1: OpenMP waits under contention)")
    a = p.parse_args(argv)
    dctx = [int(c) for c in a.decode_contexts.split(",") if c]
    model = load_model(a.model, max([a.context, *dctx]) + a.new_tokens + 8)
    cfg = model.cfg
    print(f"model={model.name} layers={cfg.num_layers} heads={cfg.num_heads}/{cfg.num_kv_heads} "
          f"head_dim={cfg.head_dim} hidden={cfg.hidden_size} | jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} cpus")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, a.context).tolist()
    snap = methods.SnapKV(budget=a.budget, window=a.window, kernel=5, pooling="avg", gqa="mean")
    parts = {int(x) for x in a.parts.split(",") if x}
    if 1 in parts:
        part1(a, model, ids, snap)
    if 2 in parts:
        part2(a, model, dctx, rng, snap)
    if 3 in parts:
        part3(a, model, dctx, rng, snap)
    return 0


def part1(a, model, ids, snap):
    """kvjax vs transformers + kvpress."""
    from kvjax.models.checkpoint import save_hf

    cfg = model.cfg
    print(f"\n[1] SnapKV budget {a.budget} (window {a.window}, avgpool 5, GQA mean), context "
          f"{a.context}, {a.new_tokens} greedy tokens, batch 1")
    comp, ttft, tpot, toks, _ = kvjax_run(model, ids, snap, a.new_tokens, a.repeats)
    print(f"  kvjax : prefill+compress {ttft * 1e3:8.1f} ms   decode {1 / tpot:8.1f} tok/s "
          f"({tpot * 1e3:.2f} ms/token)   [compile {comp:.1f} s, not timed]")
    if not a.skip_torch:
        from importlib.metadata import version

        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        import kvpress
        import torch
        import transformers

        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(a.torch_threads)

        with tempfile.TemporaryDirectory() as d:
            save_hf(Path(d), cfg, model.params)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                d, dtype=torch.float32, attn_implementation="sdpa").eval()
        r = 1 - a.budget / a.context
        assert kvpress.utils.compute_n_kept(a.context, r) == a.budget
        press = kvpress.SnapKVPress(compression_ratio=r, window_size=a.window, kernel_size=5)
        t_ttft, t_tpot, t_toks, kept = torch_run(hf, press, ids, a.new_tokens, a.repeats)
        same = sum(x == y for x, y in zip(toks, t_toks))
        print(f"  torch : prefill+compress {t_ttft * 1e3:8.1f} ms   decode {1 / t_tpot:8.1f} "
              f"tok/s ({t_tpot * 1e3:.2f} ms/token)   [torch {torch.__version__}, "
              f"transformers {transformers.__version__}, kvpress {version('kvpress')}, "
              f"{torch.get_num_threads()} threads; cache after decode {kept} slots]")
        print(f"  ratio kvjax/torch: prefill+compress time {ttft / t_ttft:.3f}x, decode tokens/s "
              f"{t_tpot / tpot:.3f}x   (greedy tokens equal: {same}/{a.new_tokens})")



def part2(a, model, dctx, rng, snap):
    """Compressed vs full decode step (kvjax)."""
    from kvjax import methods

    print(f"\n[2] kvjax decode step, SnapKV budget {a.budget} vs full cache")
    print(f"  {'context':>7} {'full ms/tok':>11} {'snapkv ms/tok':>13} {'ratio':>6} "
          f"{'full ttft ms':>12} {'snapkv ttft ms':>14} {'kv live/full':>12}")
    for n in dctx:
        ids_n = rng.integers(3, model.cfg.vocab_size, n).tolist()
        _, f_ttft, f_tpot, _, _ = kvjax_run(model, ids_n, methods.Method(), a.new_tokens,
                                            a.repeats)
        _, s_ttft, s_tpot, _, st = kvjax_run(model, ids_n, snap, a.new_tokens, a.repeats)
        frac = st["kv_bytes_live"] / st["kv_bytes_full"]
        print(f"  {n:>7} {f_tpot * 1e3:>11.2f} {s_tpot * 1e3:>13.2f} {s_tpot / f_tpot:>6.3f} "
              f"{f_ttft * 1e3:>12.1f} {s_ttft * 1e3:>14.1f} {frac:>12.4f}", flush=True)


def part3(a, model, dctx, rng, snap):
    """Decode's layer loop: the stacked scan vs per-layer buffers (kvjax)."""
    from kvjax import methods
    from kvjax.pallas.dispatch import Kernels

    print(f"\n[3] kvjax decode's layer loop (Kernels.decode_layers), scan vs per_layer, "
          f"{a.new_tokens} greedy tokens, batch 1")
    print(f"  {'context':>7} {'method':>7} {'compile s':>17} {'ratio':>6} {'ms/token':>17} "
          f"{'ratio':>6} {'tokens':>6}")
    for n in dctx:
        ids_n = rng.integers(3, model.cfg.vocab_size, n).tolist()
        for name, m in (("full", methods.Method()), ("snapkv", snap)):
            (c0, _, t0, tok0, _), (c1, _, t1, tok1, _) = (
                kvjax_run(model, ids_n, m, a.new_tokens, a.repeats, Kernels(decode_layers=lay))
                for lay in ("scan", "per_layer"))
            print(f"  {n:>7} {name:>7} {c0:>7.1f} -> {c1:>6.1f} {c1 / c0:>6.2f} "
                  f"{t0 * 1e3:>7.2f} -> {t1 * 1e3:>6.2f} {t1 / t0:>6.3f} "
                  f"{'equal' if tok0 == tok1 else 'DIFFER':>6}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
