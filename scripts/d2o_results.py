"""D2O fidelity: accuracy at kept fractions rho and teacher-forced long-text perplexity.

    python scripts/d2o_results.py                                  # the full run (hours on CPU)
    python scripts/d2o_results.py --samples 2 --ratios 0.5 --ppl-tokens 600 --prompt 256 \
        --out /tmp/d2o                                             # a taste

    python scripts/d2o_results.py --model smollm2-135m --ppl-only \
        docs/results/smollm2/d2o_ppl_genesis.jsonl --ppl-text genesis    # perplexity alone
    python scripts/d2o_results.py --model qwen2.5-coder-0.5b --ppl-text genesis \
        --ppl-tokens 2048 --ratios 0.2,0.4 --methods d2o,d2o_code --layer-sizes  # S_l

Accuracy: one `python -m kvjax.run --ratio <1 - rho> --task <tasks> --context 2048` per
method (`d2o` without merging is `d2o` with `--set merge=false`), records in
<out>/d2o_acc_<label>.json. Perplexity: a long text (`--ppl-text`: the synthetic haystack,
`kvjax.tasks.haystack.long_text`, Genesis in the King James Version or RULER's essays,
`kvjax.tasks.prose`)
is prefilled for `--prompt` tokens with each method's cache at rho of that prompt, then fed
token by token (teacher forcing, `engine.extend` under jit, the method's decode hook
evicting/merging at every step); NLL of every next token. `--ppl-only FILE` measures
only the perplexity and appends one JSON line per method, rho and span to FILE, with
the mean NLL of each 128-token block (`nll_blocks`, for an interval) and the layer sizes
the method's prefill chose (`layer_sizes`: D2O's S_l; `layer_ratios`: d2o_code's r_l; since
2026-11-29); a rerun skips what FILE holds; otherwise the script writes docs/results/tiny/d2o.md
(tables via `kvjax.report`, plots when matplotlib imports). Methods not registered are
listed as missing rather than run (roco and cam are registered since kvjax/methods/d2o/roco.py
and cam.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax import api, engine, methods, report  # noqa: E402
from kvjax.cli import records  # noqa: E402
from kvjax.cli.args import UsageError  # noqa: E402
from kvjax.models.checkpoint import provenance  # noqa: E402
from kvjax.tasks.prose import text_ids  # noqa: E402

METHODS = ["full", "streaming_llm", "h2o", "roco", "cam", "pyramidkv", "d2o", "d2o:merge=false"]


def split(label: str) -> tuple[str, dict]:
    name, _, rest = label.partition(":")
    sets = dict(kv.split("=") for kv in rest.split(",") if kv)
    return name, sets


def accuracy(a, out: Path) -> list[dict]:
    recs = []
    for label in a.methods:
        name, sets = split(label)
        if name not in methods.names():
            print(f"{name}: not registered, skipped", file=sys.stderr)
            continue
        path = out / f"d2o_acc_{label.replace(':', '_').replace('=', '-')}.json"
        args = ["--model", a.model, "--method", name, "--task", a.tasks, "--context",
                str(a.context), "--samples", str(a.samples), "--seed", str(a.seed),
                "--no-progress"]
        if name != "full":
            # rho is the kept fraction (the paper's); `--ratio` is kvpress's removed one
            args += ["--ratio", ",".join(str(round(1 - r, 6)) for r in a.ratios)]
        for k, v in sets.items():
            args += ["--set", f"{k}={v}"]
        report.run_once(path, args, ROOT)
        for r in report.load_records(path):
            recs.append({**r, "label": label})
    return recs


def kept(record: dict) -> float:
    """rho of a `kvjax.run` record: 1 - its compression ratio (1 for the full cache)."""
    r = record.get("ratio")
    return 1.0 if r is None else round(1 - r, 6)


def _prefill(model, method, ids: list[int], prompt: int):
    """The prompt prefilled into the method's cache, sized for the rest of `ids`."""
    capacity = method.decode_capacity(method.cache_slots(prompt, model.cfg), 0,
                                      len(ids) - prompt)
    return engine.prefill(model.params, jnp.array([ids[:prompt]]),
                          jnp.ones((1, prompt), bool), cfg=model.cfg, method=method,
                          capacity=capacity)


def layer_sizes(model, method, ids: list[int], prompt: int) -> dict:
    """Each layer's cache size after the prompt (the method's `layer_sizes` statistic:
    D2O's S_l of Eq. 5/13), or, for `d2o_code`, which sizes its layers at the first decoding
    step, its kept fractions r_l (`layer_ratios`); {} for a method with neither
    (docs/methods.md, D2O's "Stats")."""
    return _layers_of(_prefill(model, method, ids, prompt)[3])


def _layers_of(stats) -> dict:
    if "layer_sizes" in stats:
        return {"layer_sizes": [int(x) for x in np.asarray(stats["layer_sizes"])[0]]}
    if "layer_ratios" in stats:
        return {"layer_ratios": [round(float(x), 4) for x in np.asarray(stats["layer_ratios"])[0]]}
    return {}


def token_nll(model, method, ids: list[int], prompt: int) -> tuple[np.ndarray, dict]:
    """-log p(ids[t] | ids[:t]) for t = prompt..T-1, decoding with the method's cache; and
    the layer sizes its prefill chose (`layer_sizes`)."""
    cfg, params = model.cfg, model.params
    T = len(ids)
    logits, cache, state, stats = _prefill(model, method, ids, prompt)
    layers = _layers_of(stats)
    logp = []  # kept on the device: one host transfer at the end, not a sync per token
    for t in range(prompt, T):
        logp.append(jax.nn.log_softmax(logits[0].astype(jnp.float32))[ids[t]])
        if t + 1 < T:
            logits, cache, state = engine.extend(params, cache, jnp.array([[ids[t]]]),
                                                 jnp.ones((1, 1), bool), state, cfg=cfg,
                                                 method=method)
    return -np.asarray(jnp.stack(logp), np.float64), layers


def _method_at(name: str, sets: dict, rho: float | None, prompt: int):
    """A method with its `--methods` settings (JSON-decoded), keeping rho of the prompt
    (None: its own budget, the full cache)."""
    m = methods.create(name, **sets)
    return m if rho is None else m.with_budget(max(1, int(round(prompt * rho))))


def spans(prompt: int, split: int, T: int) -> list[tuple[int, int]]:
    """Token ranges the perplexity is reported over: all, then before/after `split` (the
    longest context the model was trained on) when it falls inside."""
    return [(prompt, T)] + ([(prompt, split), (split, T)] if prompt < split < T else [])


def main() -> None:
    p = report.results_parser(__doc__, ROOT / "docs" / "results" / "tiny")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ratios", default="0.2,0.3,0.5")
    p.add_argument("--tasks", default="niah_multikey,kv_retrieval,variable_tracking")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ppl-tokens", type=int, default=4608)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--ppl-split", type=int, default=2048,
                   help="also report perplexity before/after this position (trained length)")
    p.add_argument("--ppl-text", default="haystack", help="haystack, genesis or essays")
    p.add_argument("--ppl-only", type=Path, metavar="FILE",
                   help="only the perplexity, appended as JSON lines to FILE (resumable)")
    p.add_argument("--layer-sizes", action="store_true",
                   help="print each method's per-layer cache sizes after the perplexity "
                        "text's prompt at each rho (one prefill each; D2O's S_l) and exit")
    a = p.parse_args()
    a.methods = a.methods.split(",")
    a.ratios = [float(r) for r in a.ratios.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)

    if a.ppl_only:  # one writer: two resumes would each run the runs the file lacks
        try:
            records.hold(a.ppl_only)
        except UsageError as e:
            raise SystemExit(f"error: --ppl-only {e}") from None
    acc = [] if a.ppl_only or a.layer_sizes else accuracy(a, a.out)
    model = api.load(a.model)
    ids = text_ids(a.ppl_text, model.encode, a.ppl_tokens)
    done = report.load_records(a.ppl_only) if a.ppl_only and a.ppl_only.exists() else []
    setting = dict(model=model.name, model_weights=provenance(model.path), text=a.ppl_text,
                   tokens=len(ids), prompt=a.prompt)
    if a.layer_sizes:
        for label in a.methods:
            name, sets = split(label)
            if name not in methods.names():
                raise SystemExit(f"--methods {label}: {name!r} is not a registered method")
            for rho in ([] if name == "full" else a.ratios):
                m = _method_at(name, {k: json.loads(v) for k, v in sets.items()}, rho,
                               a.prompt)
                print(json.dumps({"label": label, "rho": rho, "budget": m.budget,
                                  **layer_sizes(model, m, ids, a.prompt)}))
        return
    ppl = []
    for label in a.methods:
        name, sets = split(label)
        if name not in methods.names():
            continue
        sets = {k: json.loads(v) for k, v in sets.items()}
        for rho in ([None] if name == "full" else a.ratios):
            key = dict(setting, label=label, rho=rho or 1.0)
            if any(all(r.get(k) == v for k, v in key.items()) for r in done):
                continue
            m = _method_at(name, sets, rho, a.prompt)
            t0 = time.perf_counter()
            nll, layers = token_nll(model, m, ids, a.prompt)
            for lo, hi in spans(a.prompt, a.ppl_split, len(ids)):
                ppl.append({"label": label, "rho": rho or 1.0, "span": f"{lo}-{hi}",
                            "ppl": float(np.exp(nll[lo - a.prompt:hi - a.prompt].mean()))})
                print(ppl[-1], file=sys.stderr)
                if a.ppl_only:  # per-block mean NLL: the spread behind an interval
                    blk = nll[lo - a.prompt:hi - a.prompt]
                    blocks = [float(b.mean())
                              for b in np.array_split(blk, max(1, len(blk) // 128))]
                    with open(a.ppl_only, "a") as f:
                        f.write(json.dumps({**key, **ppl[-1], "nll_blocks": blocks,
                                            "method_params": sets, **layers,
                                            "wall_s": round(time.perf_counter() - t0, 1)})
                                + "\n")
    if a.ppl_only:
        return

    missing = [x for x in a.methods if split(x)[0] not in methods.names()]
    ppl_weights = {"model": model.name, "model_weights": provenance(model.path)}
    parts = ["# D2O: accuracy and long-text perplexity (tiny-retrieval)", "",
             f"Command: `python scripts/d2o_results.py --model {a.model} --samples {a.samples} "
             f"--seed {a.seed} --methods {','.join(a.methods)} --tasks {a.tasks} "
             f"--context {a.context} --ratios {','.join(map(str, a.ratios))} "
             f"--ppl-tokens {a.ppl_tokens} --prompt {a.prompt} --ppl-split {a.ppl_split} "
             f"--out {a.out}`; {report.model_line(acc + [ppl_weights])}.", ""]
    if missing:
        parts += [f"Not run (not registered): {', '.join(missing)}", ""]
    if acc:
        parts += ["## Accuracy (context %d)" % a.context, "",
                  report.markdown_table(acc, lambda r: r["label"],
                                        lambda r: f"{r['task']} rho={kept(r)}",
                                        lambda r: r["accuracy"], row_name="method"), ""]
    parts += [f"## Teacher-forced perplexity ({len(ids)} tokens, prompt {a.prompt})", "",
              "Perplexity of the tokens in each span (positions `lo-hi`), the first `--prompt` "
              "tokens prefilled with the method's cache at rho of the prompt:", "",
              report.markdown_table(ppl, lambda r: r["label"],
                                    lambda r: f"rho={r['rho']} {r['span']}",
                                    lambda r: r["ppl"], row_name="method"), ""]
    whole = [r for r in ppl if r["span"] == f"{a.prompt}-{len(ids)}"]
    try:
        report.plot_lines(whole, lambda r: r["label"], lambda r: r["rho"], lambda r: r["ppl"],
                          a.out / "d2o_ppl.png", "kept fraction rho", "perplexity")
        parts += ["![perplexity](d2o_ppl.png)", ""]
    except Exception as e:  # noqa: BLE001 (matplotlib absent)
        print(f"no plot: {e}", file=sys.stderr)
    report.write_page(a.out / "d2o.md", "\n".join(parts))
    print(a.out / "d2o.md")


if __name__ == "__main__":
    main()
