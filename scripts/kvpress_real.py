"""kvjax against NVIDIA kvpress on a packaged real model: the same token ids, the same
weights, each method's kept (layer, KV head, position) sets and the question's next-token
logits. The tests (tests/test_kvpress_parity.py, tests/test_criticalkv.py) hold this on
tiny random models; this runs their comparison on a real model and a real task prompt.

    python scripts/kvpress_real.py --model qwen2.5-coder-0.5b --context 2048
    python scripts/kvpress_real.py --model smollm2-135m --context 1024 --cases snapkv

The weights: the model as kvjax loads it (GGUF dequantized to float32), written as an HF
checkpoint (`checkpoint.save_hf`) and loaded by transformers, so both sides hold the same
float32 numbers. The prompt: one niah_single sample of kvjax's task suite, its context
compressed to 1/8 (context-only, the question on top, as kvpress's pipeline runs it).
kvpress's own defaults on both sides: window 64, average pooling over 5 (the scorer
kvpress has), GQA mean; CriticalKV's first stage 0.5, epsilon 1e-4. A set mismatch is
forgiven only where the swapped entries' kvjax scores differ by < 1e-6 relative (a float
tie), as in the tests. Needs the test extras (torch, transformers, kvpress). Prints a
Markdown table; `--out` writes it to a file too (`--append`: after what it holds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CASES = ("snapkv", "ada_snapkv", "critical_snapkv", "critical_adakv")


def _setup(case: str, r: float, budget: int):
    """(kvpress press, kvjax method, attention implementation, question tokens, scores)."""
    import kvpress
    import test_criticalkv as tc
    import test_kvpress_parity as kvp

    from kvjax import methods

    snap = kvpress.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5)
    m = methods.create(case, budget=budget, window=64, kernel=5, pooling="avg")
    # AdaKV: kvpress's masked cache rejects eager attention, and its fake key is found for
    # one question token only (tests/test_kvpress_parity.py)
    press, attn, nq = {"snapkv": (snap, "eager", None),
                       "ada_snapkv": (kvpress.AdaKVPress(snap), "sdpa", 1),
                       "critical_snapkv": (kvpress.CriticalKVPress(snap), "eager", None),
                       "critical_adakv": (kvpress.CriticalAdaKVPress(snap), "sdpa", 1)}[case]
    return press, m, attn, nq, tc._crit_scores if case.startswith("critical") else kvp._our_scores


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/kvpress_real.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES}")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    p.add_argument("--append", action="store_true", help="add the table to --out's")
    a = p.parse_args(argv)
    cases = a.cases.split(",")
    if bad := [c for c in cases if c not in CASES]:
        p.error(f"--cases: unknown {bad}; allowed: {','.join(CASES)}")

    import jax
    import numpy as np
    import kvpress
    import test_kvpress_parity as kvp
    import torch
    import transformers

    import kvjax
    from kvjax import tasks
    from kvjax.models.checkpoint import save_hf, weights_sha256

    jax.config.update("jax_default_matmul_precision", "highest")  # as the tests
    model = kvjax.load(a.model)
    # --context counts the model's tokens, context and question, as `kvjax.run` does
    s = tasks.fit("niah_single", a.context,
                  lambda x: sum(map(len, model.prompt_ids(x.context, x.question, sep=x.sep))),
                  n=1, seed=0)[0]
    c_ids, q_ids = model.prompt_ids(s.context, s.question, sep=s.sep)
    ctx, q_all = np.array([c_ids]), np.array([q_ids])
    n = ctx.shape[1]
    budget = n // 8
    if budget <= 64:
        p.error(f"--context {a.context}: 1/8 of its {n} context tokens is {budget}, not above "
                "the observation window of 64 (where kvpress and kvjax both keep part of the "
                "window only, a degenerate setting); allowed: --context >= 1024")
    r = 1 - budget / n  # kvpress keeps int(n (1 - r)) entries
    if kvpress.utils.compute_n_kept(n, r) != budget:  # float rounding below the integer
        r = 1 - (budget + 0.5) / n
    with tempfile.TemporaryDirectory() as d:
        save_hf(d, model.cfg, model.params)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32).eval()
    lines = [f"kvjax vs kvpress {kvpress_version()} on {a.model} (weights sha256 "
             f"{weights_sha256(model.path)[:12]}), one niah_single context of {n} tokens "
             f"compressed to {budget} entries per (layer, KV head); {model.cfg.num_layers} "
             f"layers x {model.cfg.num_kv_heads} KV heads. `python scripts/kvpress_real.py "
             f"--model {a.model} --context {a.context}`.", "",
             "| method | kept sets | (layer, head) pairs that differ | tie swaps | "
             "logits max abs diff (max abs logit) | s |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for case in cases:
        t0 = time.perf_counter()
        press, method, attn, nq, scores = _setup(case, r, budget)
        q = q_all[:, :nq] if nq else q_all
        theirs, ref = kvp._press_run(hf, press, ctx, q, attn)
        ours, logits, _ = kvp._ours(model.cfg, model.params, method, ctx, q)
        differ = sum(o != t for ol, tl in zip(ours, theirs) for o, t in zip(ol, tl))
        try:
            ties = kvp._compare_sets(case, ours, theirs,
                                     lambda: scores(model.cfg, model.params, method, ctx),
                                     per_layer="ada" in case)
            verdict = "equal" if not differ else "equal up to float ties"
        except AssertionError:
            ties, verdict = "-", "**differ**"
        err = float(np.abs(logits - ref).max())
        line = (f"| {case} | {verdict} | {differ} of {len(ours) * len(ours[0])} | {ties} | "
                f"{err:.2e} ({float(np.abs(ref).max()):.1f}) | {time.perf_counter() - t0:.0f} |")
        lines.append(line)
        print(line, flush=True)
    if a.out:
        with open(a.out, "a" if a.append else "w") as f:
            f.write(("\n" if a.append else "") + "\n".join(lines) + "\n")
    return 0


def kvpress_version() -> str:
    from importlib.metadata import version

    return version("kvpress")


if __name__ == "__main__":
    raise SystemExit(main())
