"""SlimInfer fidelity and cost on the bundled model: writes docs/results/tiny/sliminfer.md.

    python scripts/sliminfer_results.py                 # the full sweep (hours on CPU)
    python scripts/sliminfer_results.py --model random --samples 2 --contexts 512 \\
        --tasks niah_single,common_words --out /tmp/sliminfer_taste     # a taste

One `python -m kvjax.run --details` per method over tasks x contexts, question-aware:

    python -m kvjax.run --model tiny-retrieval --method <m> --task <tasks> --context 2048,4088
        --samples 50 --details --output <out>/sliminfer_<m>.json

(4088: the bundled model has 4096 positions and the answer needs 8 of them.)

for `full`, `lazyllm` (same layers, 50% per layer), `sliminfer` (the paper's (8k, 4k, 2k)/32k
schedule scaled; decode revives pruned blocks), `sliminfer_restrict` (same prefill; decode
only among blocks with KV: the other way of serving deeper layers) and
`sliminfer_aggressive` ((4k, 2k, 1k)/32k). A JSON that exists is not re-run (delete it to
re-measure). Then it writes `<out>/sliminfer.md` with, per task and context: accuracy; the
computed prefill FLOP ratio (per-layer token counts of each sample) and the measured TTFT
ratio vs `full` (same machine, same samples); device-resident KV bytes vs a full cache
(SlimInfer: mean over decode steps; the others: after prefill); the fraction of decode
steps that swapped blocks at gamma 0.9, blocks revived/fetched and bytes moved per step;
and plots when matplotlib imports. Every number comes from those JSON records.

`--model random`: the bundled architecture with random weights and the task tokenizer,
saved to `<out>/random-model` (accuracy is then meaningless: for checking the pipeline).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax import report  # noqa: E402

METHODS = "full,lazyllm,sliminfer,sliminfer_restrict,sliminfer_aggressive"
TASKS = "niah_multikey,kv_retrieval,variable_tracking,common_words,frequent_words"


def model_dir(a, out: Path) -> str:
    """The model argument for kvjax.run (a random checkpoint is written once)."""
    if a.model != "random":
        return a.model
    path = out / "random-model"
    if not (path / "config.json").exists():
        import jax

        from kvjax.models.checkpoint import save_hf
        from kvjax.tasks.tokenizer import save_tokenizer
        from kvjax.train import init_params, load_configs

        cfg, _, _ = load_configs(ROOT / "configs/models/tiny-retrieval.yaml")
        save_hf(path, cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.1))
        save_tokenizer(path)
    return str(path)


def model_config(model: str):
    from kvjax.api import BUNDLED, BUNDLED_DIR
    from kvjax.config import ModelConfig

    path = BUNDLED_DIR / model if model in BUNDLED else Path(model)
    return ModelConfig.from_json(path / "config.json")


def run_method(a, method: str, model: str, out: Path) -> Path:
    return report.run_once(out / f"sliminfer_{method}.json", [
        "--model", model, "--method", method, "--task", a.tasks, "--context", a.contexts,
        "--samples", str(a.samples), "--seed", str(a.seed), "--batch-size", str(a.batch_size),
        "--details", *(["--no-progress"] if a.no_progress else [])], ROOT)


def per_sample(r: dict, key: str) -> list:
    return [d[key] for d in r.get("details", []) if key in d]


def derive(records: list[dict], cfg) -> list[dict]:
    """Add the per-record figures the tables show (means over samples)."""
    from kvjax.methods.slim.blocks import prefill_flop_ratio

    full = {(r["task"], r["context_length"]): r for r in records if r["method"] == "full"}
    for r in records:
        lt = per_sample(r, "layer_tokens")  # layer 0 sees the whole prompt
        r["flop_ratio"] = float(np.mean([prefill_flop_ratio(cfg, t, t[0]) for t in lt])) \
            if lt else 1.0
        base = full.get((r["task"], r["context_length"]))
        r["ttft_ratio"] = r["ttft_s"] / base["ttft_s"] if base else float("nan")
        dev, devf = per_sample(r, "device_kv_bytes"), per_sample(r, "device_kv_bytes_full")
        r["kv_ratio"] = float(np.mean(dev) / np.mean(devf)) if dev else r["kv_fraction"]
        for key in ("swap_step_fraction", "bytes_per_step", "blocks_revived", "blocks_fetched",
                    "decode_steps"):
            v = per_sample(r, key)
            r[key] = float(np.mean(v)) if v else float("nan")
    return records


def write_report(records: list[dict], a, out: Path, command: str) -> str:
    key = lambda r: (METHODS.split(",").index(r["method"]) if r["method"] in METHODS else 99)
    records = sorted(records, key=key)
    col = lambda r: f"{r['task']} @{r['context_length']}"
    parts = [
        "# SlimInfer on the bundled model (tiny-retrieval)",
        "",
        f"Measured by `{command}` (one `python -m kvjax.run --details` per method; records in "
        f"`sliminfer_<method>.json`). Question-aware, {a.samples} samples per cell, seed "
        f"{a.seed}, {report.model_line(records)}. Methods: `lazyllm` = LazyLLM at SlimInfer's "
        "layers keeping 50% of the present tokens at each; `sliminfer` = the paper's "
        "(8k, 4k, 2k)/32k schedule scaled to the context and depth, decode reviving pruned "
        "blocks from their hidden states; `sliminfer_restrict` = same prefill, decode only "
        "among blocks with KV (never swaps); `sliminfer_aggressive` = (4k, 2k, 1k)/32k.",
        "",
        "## Accuracy (%)", "",
        report.markdown_table(records, lambda r: r["method"], col, lambda r: 100 * r["accuracy"],
                              fmt="{:.0f}", row_name="method", mean_col=True),
        "", "## Prefill: computed FLOP ratio vs full (attention + projections + MLP per layer)",
        "",
        report.markdown_table(records, lambda r: r["method"], col, lambda r: r["flop_ratio"],
                              fmt="{:.3f}", row_name="method"),
        "", "## Prefill: measured TTFT ratio vs full (same run, same samples)", "",
        report.markdown_table(records, lambda r: r["method"], col, lambda r: r["ttft_ratio"],
                              fmt="{:.3f}", row_name="method"),
        "", "## Device-resident KV bytes / full cache (SlimInfer: mean per decode step)", "",
        report.markdown_table(records, lambda r: r["method"], col, lambda r: r["kv_ratio"],
                              fmt="{:.3f}", row_name="method"),
    ]
    slim = [r for r in records if r["method"].startswith("sliminfer")]
    if slim:
        parts += ["", "## Decoding with host offload (gamma 0.9)", "",
                  "Fraction of decode steps in which any stage swapped:", "",
                  report.markdown_table(slim, lambda r: r["method"], col,
                                        lambda r: r["swap_step_fraction"], fmt="{:.3f}",
                                        row_name="method"),
                  "", "Bytes moved host<->device per step (KV fetched/offloaded and hidden "
                  "states of revived blocks):", "",
                  report.markdown_table(slim, lambda r: r["method"], col,
                                        lambda r: r["bytes_per_step"], fmt="{:.0f}",
                                        row_name="method"),
                  "", "Blocks revived (recomputed from hidden states) / fetched per sample:", "",
                  report.markdown_table(slim, lambda r: r["method"], col,
                                        lambda r: f"{r['blocks_revived']:.1f} / "
                                                  f"{r['blocks_fetched']:.1f}",
                                        fmt="{}", row_name="method")]
    for task in sorted({r["task"] for r in records}):
        png = report.plot_lines([r for r in records if r["task"] == task],
                                lambda r: r["method"], lambda r: r["context_length"],
                                lambda r: 100 * r["accuracy"], out / f"sliminfer_{task}.png",
                                "context (tokens)", "accuracy (%)", task, logx=True)
        if png is not None:
            parts += ["", f"![{task}]({png.name})"]
    # one point per (method, context): the mean over tasks the title promises
    cells = {}
    for r in records:
        cells.setdefault((r["method"], r["context_length"]), []).append(r["ttft_ratio"])
    means = [{"method": m, "context_length": c, "ttft_ratio": float(np.mean(v))}
             for (m, c), v in cells.items()]
    png = report.plot_lines(means, lambda r: r["method"],
                            lambda r: r["context_length"], lambda r: r["ttft_ratio"],
                            out / "sliminfer_ttft.png", "context (tokens)", "TTFT / full",
                            "measured TTFT ratio (mean over tasks)", logx=True)
    if png is not None:
        parts += ["", f"![ttft]({png.name})"]
    text = "\n".join(parts) + "\n"
    report.write_page(out / "sliminfer.md", text)
    return text


def main(argv=None) -> int:
    p = report.results_parser(__doc__, ROOT / "docs" / "results" / "tiny")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--contexts", default="2048,4088")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    model = model_dir(a, a.out)
    records = []
    for m in a.methods.split(","):
        records += report.load_records(run_method(a, m, model, a.out))
    records = derive(records, model_config(model))
    command = "python scripts/sliminfer_results.py " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:])
    print(write_report(records, a, a.out, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
