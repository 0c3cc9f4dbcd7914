"""Public API (load/generate/compress) and `python -m kvjax.run` on a small random model."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

import kvjax
from kvjax import run as cli
from kvjax.config import ModelConfig
from kvjax.models import checkpoint
from kvjax.train import export_model, init_params

CFG = ModelConfig(family="llama", vocab_size=1408, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_ids=(2,),
                  tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    export_model(d, CFG, init_params(CFG, jax.random.PRNGKey(0), std=0.2), {"model": {}})
    return d


def test_load_generate_compress(model_dir):
    model = kvjax.load(model_dir)
    assert model.cfg == CFG and model.tokenizer is not None
    r = kvjax.generate(model, "the sky is blue . what is the special magic number ?",
                       max_new_tokens=6, stop_ids=())
    assert isinstance(r.text, str) and len(r.tokens) == 6
    assert r.stats["kv_bytes_live"] > 0 and r.stats["ttft_s"] > 0
    ids = model.encode("the sky is blue .")
    assert ids[0] == CFG.bos_token_id
    rb = kvjax.generate(model, [ids, ids[:3]], max_new_tokens=4, stop_ids=())
    assert len(rb.text) == 2 and rb.tokens[0] == kvjax.generate(model, ids, max_new_tokens=4,
                                                                 stop_ids=()).tokens
    cache, stats = kvjax.compress(model, "the sky is blue .", question="what ?")
    n = len(model.encode("the sky is blue .")) + len(model.encode("what ?", bos=False))
    assert int(cache.valid[0, 0, 0].sum()) == n
    assert stats["kv_bytes_live"] == stats["kv_bytes_full"]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a bundled model"):
        kvjax.load(tmp_path / "nope")


def test_methods_registry():
    assert "full" in kvjax.methods.names()
    assert kvjax.methods.create("full") == kvjax.methods.Full()
    with pytest.raises(ValueError, match="unknown method 'nope'.*full"):
        kvjax.methods.create("nope")
    with pytest.raises(ValueError, match="no parameter"):
        kvjax.methods.create("full", budget=3)


def _run(*args):
    return subprocess.run([sys.executable, "-m", "kvjax.run", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_lists():
    r = _run("--list-methods")
    assert r.returncode == 0 and "full" in r.stdout.split()
    r = _run("--list-tasks")
    assert r.returncode == 0 and "niah_single\tretrieval" in r.stdout


def test_cli_run_writes_records(model_dir, tmp_path):
    out = tmp_path / "r.json"
    rc = cli.main(["--model", str(model_dir), "--method", "full", "--task", "niah_single,passkey",
                   "--context", "128", "--samples", "3", "--batch-size", "2", "--output", str(out),
                   "--details", "--no-progress", "--scenario", "context_only"])
    assert rc == 0
    recs = json.loads(out.read_text())["records"]
    assert [r["task"] for r in recs] == ["niah_single", "passkey"]
    for r in recs:
        for key in ("method", "budget", "task", "context_length", "samples", "accuracy",
                    "kv_bytes_live", "kv_bytes_full", "ttft_s", "tpot_s", "method_stats",
                    "versions"):
            assert key in r
        assert r["samples"] == 3 and len(r["details"]) == 3 and 0 <= r["accuracy"] <= 1
        assert r["versions"]["jax"] == jax.__version__
        assert r["kv_fraction"] == pytest.approx(1.0)
        # the weights the figures belong to (a retrained model must not pass for this one)
        assert r["model_weights"] == {"sha256": checkpoint.weights_sha256(model_dir),
                                      "trained_steps": None}


def test_cli_drops_executables_between_methods(model_dir, tmp_path, monkeypatch):
    # a sweep keeps one (method, budget)'s executables at a time: all of them stay mapped
    # otherwise, and ~110 compilations exhaust vm.max_map_count
    from kvjax import engine

    held, clear = [], engine.clear_compiled
    monkeypatch.setattr(engine, "clear_compiled",
                        lambda: (held.append(len(engine.executables._EXECUTABLES)), clear()))
    rc = cli.main(["--model", str(model_dir), "--method", "full,streaming_llm", "--budget",
                   "48,64", "--task", "passkey", "--context", "128", "--samples", "1",
                   "--max-new-tokens", "2", "--output", str(tmp_path / "r.json"),
                   "--no-progress"])
    assert rc == 0
    assert len(held) == 3 and held[1] > 0 and held[2] > 0  # full, then each budget


def test_output_json_is_strict():
    """ASL's relative variance is NaN at the layers it never scored: written as null."""
    out = cli._finite({"rv": [float("nan"), 0.5, (float("inf"),)], "n": 3})
    assert json.loads(json.dumps(out, allow_nan=False)) == {"rv": [None, 0.5, [None]], "n": 3}


def test_cli_bad_input(model_dir):
    r = _run("--model", str(model_dir), "--method", "nope", "--context", "128")
    assert r.returncode != 0 and "unknown method 'nope'" in r.stderr
    r = _run("--ratio", "1.5")
    assert r.returncode != 0 and "must be in [0, 1)" in r.stderr
    r = _run("--model", str(model_dir), "--task", "nope")
    assert r.returncode != 0 and "nope" in r.stderr
    with pytest.raises(ValueError, match="context_length"):
        cli.main(["--model", str(model_dir), "--task", "kv_retrieval", "--context", "16",
                  "--samples", "1", "--no-progress"])
