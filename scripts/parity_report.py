"""Print kvjax-vs-transformers logit differences per family and 2-layer compile/run times.

    python scripts/parity_report.py

The same comparisons as tests/test_parity_hf.py, printed as figures (fp32, CPU, eager).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import hf_models  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvjax import engine  # noqa: E402
from kvjax.engine import layers  # noqa: E402
from kvjax.methods import Method  # noqa: E402
from kvjax.models import transformer  # noqa: E402
from kvjax.models.checkpoint import load_hf  # noqa: E402

STEPS = 8


def main() -> None:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    print(f"{'family':>24} {'|logits|max':>11} {'prefill':>9} {'decode(8)':>9}")
    for name in sorted(hf_models.FAMILIES):
        model = hf_models.build(name)
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            cfg, params = load_hf(d)
        ids = np.random.default_rng(1).integers(3, cfg.vocab_size, size=(1, 29))
        with torch.no_grad():
            out = model(torch.tensor(ids), use_cache=True)
            ref_all = out.logits.numpy()
            ref, past = [out.logits[:, -1].numpy()], out.past_key_values
            for _ in range(STEPS):
                o = model(torch.tensor(ref[-1].argmax(-1))[:, None], past_key_values=past, use_cache=True)
                ref.append(o.logits[:, -1].numpy())
                past = o.past_key_values
        valid = jnp.ones(ids.shape, bool)
        pos = engine.positions(valid, jnp.zeros(1, jnp.int32))
        x, _, _ = layers.prefill_layers(params, cfg, jnp.asarray(ids), valid, pos, lambda io, s: (None, s))
        pre = np.abs(np.asarray(transformer.unembed(params, cfg, x)) - ref_all).max()
        tokens, v = engine.pad_left([list(ids[0])], 32, 0)
        logits, cache, _, _ = engine.prefill(params, tokens, v, cfg=cfg, method=Method(), capacity=32 + STEPS)
        ours = [np.asarray(logits)]
        for _ in range(STEPS):
            tok = jnp.argmax(logits, -1)[:, None].astype(jnp.int32)
            logits, cache, _ = engine.extend(params, cache, tok, jnp.ones((1, 1), bool), cfg=cfg, method=Method())
            ours.append(np.asarray(logits))
        dec = np.abs(np.stack(ours, 1) - np.stack(ref, 1)).max()
        print(f"{name:>24} {np.abs(ref_all).max():>11.1f} {pre:>9.1e} {dec:>9.1e}")

    cfg, params = load_hf_2layer()
    for n in (512, 2048):
        prompt = list(np.random.default_rng(0).integers(3, cfg.vocab_size, n))
        g = engine.run(params, cfg, [prompt], max_new_tokens=32, stop_ids=())
        t0 = time.perf_counter()
        g2 = engine.run(params, cfg, [prompt], max_new_tokens=32, stop_ids=())
        wall = time.perf_counter() - t0
        print(f"2-layer d=512 GQA 8/2, prompt {n}: compile {g.stats['compile_s']:.2f}s (prefill+decode), "
              f"ttft {g2.stats['ttft_s'] * 1e3:.1f} ms, tpot {g2.stats['tpot_s'] * 1e3:.2f} ms, "
              f"second run recompiled {g2.stats['compile_s']:.2f}s, wall {wall:.2f}s")


def load_hf_2layer():
    from kvjax.config import ModelConfig
    from kvjax.train import init_params

    cfg = ModelConfig(family="llama", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,))
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


if __name__ == "__main__":
    main()
