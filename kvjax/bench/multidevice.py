"""Multi-device scaling: prefill + compression and decoding on (data, model) meshes against
one device, measured in one run.

    python -m kvjax.bench.multidevice                         # every mesh the devices allow
    python -m kvjax.bench.multidevice --meshes 1x1,1x8,8x1,4x2 --methods snapkv,ada_snapkv
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m kvjax.bench.multidevice \\
        --context 1024 --batch 8 --layers 2          # emulated CPU devices: checks, not speed

A random-weight Llama-style model (`--layers`, 32 query / 8 KV heads of 128, hidden 4096
by default: the Llama-3.1-8B attention shape) runs `--batch` random prompts of `--context`
tokens through `kvjax.engine.run` with each method at `--budget` entries per layer and KV
head, then decodes `--new-tokens` tokens, once per mesh `DxM` (D-way batch over `data`, the
KV heads over `model`; `kvjax.distributed`). Each configuration is compiled and run once
before the timed run. Per row:

- `ttft_ms`: prefill + compression of the whole batch; `tpot_ms`: one decode step;
- `prefill_x`, `decode_x`: the 1x1 row's time over this row's (the speedup; ideal = the
  device count for prefill, and for decode while the step is memory-bound);
- `same`: whether the generated tokens equal the single-device ones.

Emulated CPU devices share the same cores, so their speedups say nothing about hardware;
on a GPU or TPU host with several devices the figures are the scaling.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _meshes(text: str | None, n: int, split) -> list[tuple[int, int]]:
    """"DxM,..." -> [(D, M)]; default: 1x1 and, for n > 1 devices, n x 1, 1 x n and the
    squarest split, keeping those whose M divides the model (`split(M)`)."""
    if text:
        out = []
        for item in text.split(","):
            d, _, m = item.strip().partition("x")
            if not (d.isdigit() and m.isdigit()) or int(d) < 1 or int(m) < 1:
                raise SystemExit(f"error: mesh {item!r} is not DxM with D, M >= 1 (e.g. 4x2)")
            out.append((int(d), int(m)))
        return out
    out = [(1, 1)]
    if n > 1:
        m = max(k for k in range(1, int(n**0.5) + 1) if n % k == 0)
        out += [(n, 1), (1, n)] + ([(n // m, m)] if 1 < m < n else [])
    return [(d, m) for d, m in out if split(m)]


def model_config(a):
    from kvjax.config import ModelConfig

    return ModelConfig(family="llama", vocab_size=a.vocab, hidden_size=a.hidden,
                       intermediate_size=a.intermediate, num_layers=a.layers,
                       num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                       max_position_embeddings=a.context + a.new_tokens + 64,
                       bos_token_id=1, eos_token_ids=(2,))


def measure(params, cfg, prompts, method, mesh, new_tokens: int) -> dict:
    """Run once to compile, then once timed: (ttft, tpot, tokens)."""
    from kvjax import engine

    def go():
        return engine.run(params, cfg, prompts, method, max_new_tokens=new_tokens,
                          stop_ids=(), mesh=mesh)

    go()
    t0 = time.perf_counter()
    g = go()
    wall = time.perf_counter() - t0
    return {"ttft": g.stats["ttft_s"], "tpot": g.stats["tpot_s"], "wall": wall,
            "tokens": np.asarray(g.tokens), "compile": g.stats.get("compile_s", 0.0)}


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvjax.bench.multidevice", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--meshes", default=None, help="DxM,... (default: by the device count)")
    p.add_argument("--methods", default="full,snapkv,ada_snapkv")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="default: bfloat16 on GPU/TPU, float32 on CPU")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    import jax

    from kvjax import distributed, methods
    from kvjax.train import init_params

    devices = jax.devices()
    cfg = model_config(a)
    split = lambda m: cfg.num_kv_heads % m == 0 and cfg.intermediate_size % m == 0  # noqa: E731
    meshes = _meshes(a.meshes, len(devices), split)
    for d, m in meshes:
        if not split(m):
            raise SystemExit(f"error: mesh {d}x{m}: model={m} must divide the KV heads "
                             f"({cfg.num_kv_heads}) and the MLP width ({cfg.intermediate_size})")
        if d * m > len(devices):
            raise SystemExit(f"error: mesh {d}x{m} needs {d * m} devices; {len(devices)} "
                             f"{devices[0].platform} device(s) available")
    dtype = a.dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16")
    params = jax.tree.map(lambda x: x.astype(dtype),
                          init_params(cfg, jax.random.PRNGKey(0), std=0.02))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, a.context).tolist() for _ in range(a.batch)]
    print(f"random llama: {cfg.num_layers} layers, {cfg.num_heads} q / {cfg.num_kv_heads} KV "
          f"heads of {cfg.head_dim}, hidden {cfg.hidden_size}, {dtype}; batch {a.batch} x "
          f"{a.context} tokens, {a.new_tokens} new; budget {a.budget}")
    print(f"{len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind}), "
          f"jax {jax.__version__}")
    if devices[0].platform == "cpu" and len(devices) > 1:
        print("note: emulated CPU devices share the cores: the speedups are not hardware's")
    print(f"{'method':>11} {'mesh':>5} {'ttft_ms':>9} {'tpot_ms':>8} {'prefill_x':>9} "
          f"{'decode_x':>8} {'same':>5}")
    for name in [s.strip() for s in a.methods.split(",") if s.strip()]:
        method = methods.create(name)
        if name != "full":
            method = method.with_budget(a.budget)
        base = None
        for d, m in meshes:
            mesh = None if (d, m) == (1, 1) else distributed.as_mesh(
                distributed.make_mesh(d, m), cfg)
            p = params if mesh is None else distributed.shard_params(params, cfg, mesh)
            r = measure(p, cfg, prompts, method, mesh, a.new_tokens)
            base = base or r
            same = bool(np.array_equal(r["tokens"], base["tokens"]))
            print(f"{name:>11} {d}x{m:<3} {r['ttft'] * 1e3:9.1f} {r['tpot'] * 1e3:8.2f} "
                  f"{base['ttft'] / r['ttft']:9.2f} {base['tpot'] / max(r['tpot'], 1e-9):8.2f} "
                  f"{str(same):>5}")
            del p
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
