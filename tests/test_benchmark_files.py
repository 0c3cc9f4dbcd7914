"""`--task ruler:PATH` / `longbench:PATH` from the CLI: the published jsonl layouts read,
scored with each benchmark's metric, a deterministic `--fraction`, every prediction kept
in the record with the file's path and sha256, and one `error:` line for every bad file
(tiny random models: the scores are whatever they are; what is checked is that each
recorded score is the metric of the recorded prediction)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvjax import report
from kvjax.cli import main as cli
from kvjax import tasks
from kvjax.tasks import loaders

from test_cli_api import model_dir  # noqa: F401 -- the tiny checkpoint fixture

FIXTURES = Path(__file__).parent / "fixtures"
RULER_QA = FIXTURES / "ruler_qa_1.jsonl"
RULER_NIAH = FIXTURES / "ruler_niah_multivalue.jsonl"
LB_QA = FIXTURES / "longbench_qa.jsonl"
LB_SYN = FIXTURES / "longbench_synthetic.jsonl"


def _run(capsys, *argv) -> tuple[int, str]:
    rc = cli.main([*argv, "--no-progress"])
    return rc, capsys.readouterr().err


def _records(model_dir, capsys, out, *argv):
    rc, err = _run(capsys, "--model", str(model_dir), "--max-new-tokens", "2", "--output",
                   str(out), *argv)
    assert rc == 0, err
    return report.load_records(out)


def _error(capsys, *argv) -> str:
    rc, err = _run(capsys, *argv)
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    return lines[0]


def _rescored(rec, path) -> None:
    """Each kept prediction scores, with the file's metric, what the record says; the
    accuracy is their mean."""
    samples = {s.meta["line"]: s for s in loaders.load_benchmark(rec["benchmark"]["kind"], path)}
    preds = report.predictions(rec)
    assert len(preds) == rec["samples"]
    for p in preds:
        assert tasks.score_sample(samples[p["line"]], p["prediction"]) == p["score"]
        assert p["dataset"] == samples[p["line"]].task
    assert rec["accuracy"] == pytest.approx(sum(p["score"] for p in preds) / len(preds))


def test_ruler_file(model_dir, tmp_path, capsys):
    recs = _records(model_dir, capsys, tmp_path / "r.json", "--task", f"ruler:{RULER_QA}",
                    "--details")
    (rec,) = recs
    assert rec["task"] == "ruler:ruler_qa_1" and rec["context_length"] is None
    assert rec["benchmark"] == {"kind": "ruler", "path": str(RULER_QA.resolve()),
                                "sha256": loaders.sha256(RULER_QA), "records_in_file": 3,
                                "fraction": 1.0, "metric": ["ruler_string_match_part"]}
    # with --details the details hold each prediction, the record no second copy
    assert "predictions" not in rec
    assert [(p["line"], p["id"]) for p in report.predictions(rec)] == [(1, 0), (2, 1), (3, 2)]
    assert rec["job"]["file_sha256"] == loaders.sha256(RULER_QA)
    assert rec["prompt_tokens"]["max"] > 20
    _rescored(rec, RULER_QA)


def test_ruler_directory_layout(model_dir, tmp_path, capsys):
    """RULER writes <dir>/<task>/validation.jsonl: each is one task, named by its folder."""
    data = tmp_path / "data"
    for name, src in (("qa_1", RULER_QA), ("niah_multivalue", RULER_NIAH)):
        (data / name).mkdir(parents=True)
        shutil.copy(src, data / name / "validation.jsonl")
    recs = _records(model_dir, capsys, tmp_path / "r.jsonl", "--task", f"ruler:{data}",
                    "--scenario", "context_only")
    assert [(r["task"], r["benchmark"]["metric"]) for r in recs] == [
        ("ruler:niah_multivalue", ["ruler_string_match_all"]),
        ("ruler:qa_1", ["ruler_string_match_part"])]
    for r in recs:
        _rescored(r, r["benchmark"]["path"])


def test_longbench_files_and_synthetic_tasks_in_one_sweep(model_dir, tmp_path, capsys):
    recs = _records(model_dir, capsys, tmp_path / "r.json", "--task",
                    f"passkey,longbench:{LB_QA},longbench:{LB_SYN}", "--context", "128",
                    "--samples", "1", "--method", "full,streaming_llm", "--budget", "16")
    # written task by task (the methods on one task's prompts share its prefill)
    assert [(r["method"], r["task"], r["context_length"]) for r in recs] == [
        ("full", "passkey", 128), ("streaming_llm", "passkey", 128),
        ("full", "longbench:longbench_qa", None), ("streaming_llm", "longbench:longbench_qa", None),
        ("full", "longbench:longbench_synthetic", None),
        ("streaming_llm", "longbench:longbench_synthetic", None)]
    syn = recs[4]
    # --samples caps a file's samples too: the first of those --fraction picks
    assert syn["samples"] == 1 and syn["benchmark"]["records_in_file"] == 4
    qa = _records(model_dir, capsys, tmp_path / "q.json", "--task", f"longbench:{LB_QA}")[0]
    assert sorted(qa["accuracy_by_dataset"]) == ["gov_report", "hotpotqa", "multifieldqa_zh"]
    assert qa["benchmark"]["metric"] == ["qa_f1", "qa_f1_zh", "rouge"]
    assert [p["id"] for p in qa["predictions"]] == ["made-up-0001", "made-up-0002",
                                                    "made-up-0003"]
    _rescored(qa, LB_QA)
    assert "predictions" not in recs[0] and "benchmark" not in recs[0]


def _big_ruler(path: Path, n: int = 20) -> Path:
    lines = RULER_QA.read_text().splitlines()
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({**json.loads(lines[i % 3]), "index": i}) + "\n")
    return path


def test_fraction_is_a_deterministic_share(model_dir, tmp_path, capsys):
    f = _big_ruler(tmp_path / "qa_1.jsonl")

    def lines(*argv):
        out = tmp_path / "r.json"
        rec = _records(model_dir, capsys, out, "--task", f"ruler:{f}", "--overwrite",
                       "--max-new-tokens", "0", *argv)[0]
        return [p["line"] for p in rec["predictions"]], rec

    quarter, rec = lines("--fraction", "0.25", "--seed", "1")
    assert len(quarter) == 5 and quarter == sorted(quarter)  # ceil(0.25 * 20), file order
    assert rec["benchmark"]["fraction"] == 0.25 and rec["job"]["fraction"] == 0.25
    assert lines("--fraction", "0.25", "--seed", "1")[0] == quarter
    half = lines("--fraction", "0.5", "--seed", "1")[0]
    assert len(half) == 10 and set(quarter) <= set(half)
    assert lines("--fraction", "0.25", "--seed", "2")[0] != quarter
    assert len(lines("--fraction", "0.01")[0]) == 1


def test_resume_follows_the_file(model_dir, tmp_path, capsys, monkeypatch):
    """A finished file is not measured again; an edited file (another sha256) is."""
    f = tmp_path / "qa_1.jsonl"
    shutil.copy(RULER_QA, f)
    out = tmp_path / "r.jsonl"
    argv = ["--task", f"ruler:{f}", "--resume"]
    _records_jsonl = lambda: [json.loads(x) for x in out.read_text().splitlines()]  # noqa: E731
    assert _run(capsys, "--model", str(model_dir), "--max-new-tokens", "1", "--output",
                str(out), *argv)[0] == 0
    rc, err = _run(capsys, "--model", str(model_dir), "--max-new-tokens", "1", "--output",
                   str(out), *argv)
    assert rc == 0 and "1 of 1 records already in" in err and len(_records_jsonl()) == 1
    f.write_text(f.read_text().replace("Norby", "Osk"))
    assert _run(capsys, "--model", str(model_dir), "--max-new-tokens", "1", "--output",
                str(out), *argv)[0] == 0
    shas = [r["benchmark"]["sha256"] for r in _records_jsonl()]
    assert len(shas) == 2 and shas[0] != shas[1]


def _bad(tmp_path, name: str, lines: list[str]) -> Path:
    f = tmp_path / name
    f.write_text("\n".join(lines) + "\n")
    return f


def test_bad_files_and_options_are_one_line(model_dir, tmp_path, capsys):
    m = ["--model", str(model_dir), "--max-new-tokens", "1"]
    good = json.dumps({"input": "a\nb?", "outputs": ["x"]})
    dumps = lambda **r: json.dumps(r)  # noqa: E731
    files = {  # name: lines
        "a": [good, "{not json"], "b": [good, "", "[1, 2]"],
        "c": [good, dumps(input="x")], "d": [dumps(input=3, outputs="x")],
        "e": [dumps(input="x", outputs=[])], "g": [""],
        "h": [dumps(input="word " * 1100 + "\nq?", outputs=["x"])],
    }
    f = {k: f"ruler:{_bad(tmp_path, k + '.jsonl', v)}" for k, v in files.items()}
    lb = f"longbench:{_bad(tmp_path, 'lb.jsonl', [dumps(context='c', answers=['a'], dataset='nope')])}"
    empty = tmp_path / "empty"
    empty.mkdir()
    twin = tmp_path / "twin" / RULER_QA.name  # another file of the same task name
    twin.parent.mkdir()
    shutil.copy(RULER_QA, twin)
    cases = [
        (["--task", f"ruler:{tmp_path / 'nope.jsonl'}"], "no such file or directory"),
        (["--task", f"ruler:{empty}"], "the directory holds no .jsonl task file"),
        (["--task", f["a"]], "a.jsonl:2: not a JSON line"),
        (["--task", f["b"]], "b.jsonl:3: a JSON object expected, got list"),
        (["--task", f["c"]], "c.jsonl:2: missing field(s) ['outputs']"),
        (["--task", f["d"]], "d.jsonl:1: field 'input' must be a string"),
        (["--task", f["e"]], "e.jsonl:1: field 'outputs' must be a non-empty list"),
        (["--task", lb], "lb.jsonl:1: unknown LongBench dataset 'nope'"),
        (["--task", f["g"]], "g.jsonl holds no records"),
        (["--task", f["h"]], "the sample of line 1 has"),
        (["--task", "rulr:x.jsonl"], "--task rulr:x.jsonl: unknown benchmark 'rulr'"),
        (["--task", "ruler:"], "--task ruler:: give the file or directory, ruler:PATH"),
        (["--task", f"ruler:{RULER_QA},ruler:{twin}"],
         f"task ruler:ruler_qa_1 is given twice ({RULER_QA} and {twin})"),
        (["--task", f"ruler:{RULER_QA}", "--context", "128"],
         "--context applies to the synthetic and RULER tasks"),
        (["--task", "passkey", "--context", "128", "--fraction", "0.5"],
         "--fraction applies to benchmark files"),
        (["--task", f"ruler:{RULER_QA}", "--fraction", "0"],
         "argument --fraction: 0 is outside the allowed range: a fraction in (0, 1]"),
        (["--task", f"ruler:{RULER_QA}", "--fraction", "1.5"], "a fraction in (0, 1]"),
        (["--task", f"ruler:{RULER_QA}", "--chat-template"],
         f"--chat-template: model {model_dir} has no chat template"),
        (["--task", f"ruler:{RULER_QA}", "--dtype", "fp8"], "argument --dtype: invalid choice"),
    ]
    for argv, message in cases:
        line = _error(capsys, *m, *argv)
        assert message in line, (argv, line)


# ---- an HF checkpoint: its tokenizer and chat template, from the CLI ---------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    hf_models = pytest.importorskip("hf_models")
    import hf_tokenizers

    d = tmp_path_factory.mktemp("qwen2_chat")
    hf_models.build("qwen2_bias_gqa2", vocab_size=448).save_pretrained(d)
    hf_tokenizers.qwen2(d)
    return d


@pytest.mark.parametrize("scenario", ["question_aware", "context_only"])
def test_chat_template_from_the_cli(hf_dir, tmp_path, capsys, scenario):
    """The prompts are the checkpoint's chat rendering (one user turn, the generation
    prompt): the record's token counts are those of `apply_chat_template`."""
    import kvjax

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    out = tmp_path / "r.json"
    rec = _records(hf_dir, capsys, out, "--task", f"longbench:{LB_QA}", "--chat-template",
                   "--scenario", scenario, "--details")[0]
    assert rec["chat_template"] is True and rec["job"]["chat_template"] is True
    want = []
    for s in loaders.load_longbench_jsonl(LB_QA):
        ids = hf.apply_chat_template([{"role": "user", "content": s.prompt}],
                                     add_generation_prompt=True, tokenize=True)
        want.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert rec["prompt_tokens"] == {"min": min(want), "mean": pytest.approx(sum(want) / 3),
                                    "max": max(want)}
    model = kvjax.load(hf_dir)
    plain = _records(hf_dir, capsys, tmp_path / "p.json", "--task", f"longbench:{LB_QA}",
                     "--scenario", scenario)[0]
    lengths = [len(model.encode(s.prompt)) for s in loaders.load_longbench_jsonl(LB_QA)]
    assert plain["prompt_tokens"]["max"] == max(lengths) < max(want)
    assert plain["chat_template"] is False and "chat_template" not in plain["job"]


def test_fraction_counts_in_decimals():
    """ceil(f n) of the decimal f: 0.07 of 100 samples is 7 (the float product is
    7.000000000000001); 0.071 of 100 is 8."""
    from kvjax.tasks.loaders import take_fraction

    assert len(take_fraction(100, 0.07, 0, "x")) == 7
    assert len(take_fraction(100, 0.071, 0, "x")) == 8
    assert len(take_fraction(1000, 0.29, 0, "x")) == 290
    assert take_fraction(10, 1.0, 0, "x") == list(range(10))


def test_ruler_prompt_is_the_files_text(hf_dir, tmp_path, capsys):
    """A RULER prompt is `input + answer_prefix` byte for byte, as RULER sends it (split
    at the question's line break for context-only, nothing stripped or re-joined). A file
    prepared with a chat template already holds the markup: it runs as written (no special
    tokens added on top: Qwen's and transformers' `add_special_tokens=False` ids), and
    `--chat-template` on it is one error line."""
    import json

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    rows = [json.loads(line) for line in RULER_NIAH.read_text().splitlines() if line.strip()]
    for r, s in zip(rows, loaders.load_ruler_jsonl(RULER_NIAH)):
        assert s.prompt == r["input"] + r.get("answer_prefix", "")
    rendered = tmp_path / "niah_rendered.jsonl"
    rendered.write_text("".join(json.dumps({**r, "input": hf.apply_chat_template(
        [{"role": "user", "content": r["input"]}], add_generation_prompt=True,
        tokenize=False)}) + "\n" for r in rows))
    samples = loaders.load_ruler_jsonl(rendered)
    want = [len(hf(s.prompt, add_special_tokens=False)["input_ids"]) for s in samples]
    for scenario in ("question_aware", "context_only"):
        rec = _records(hf_dir, capsys, tmp_path / f"{scenario}.json", "--task",
                       f"ruler:{rendered}", "--scenario", scenario)[0]
        assert rec["prompt_tokens"] == {"min": min(want),
                                        "mean": pytest.approx(sum(want) / len(want)),
                                        "max": max(want)}
    line = _error(capsys, "--model", str(hf_dir), "--task", f"ruler:{rendered}",
                  "--chat-template", "--no-progress")
    assert "already holds chat markup" in line and "<|im_start|>" in line


def test_longbench_leaves_few_shot_and_code_unwrapped(tmp_path):
    """LongBench's pred.py skips the chat template for trec, triviaqa, samsum, lsht, lcc and
    repobench-p: their samples say so (`Sample.chat`), the others take it."""
    import json

    from kvjax.tasks import longbench_metrics as lb

    assert lb.NO_CHAT == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert all(s.chat for s in loaders.load_longbench_jsonl(LB_QA))
    f = tmp_path / "mixed.jsonl"
    f.write_text("".join(json.dumps({"dataset": d, "context": "c", "input": "q",
                                     "answers": ["a"], "all_classes": ["a"]}) + "\n"
                         for d in ("trec", "hotpotqa", "lcc")))
    assert [s.chat for s in loaders.load_longbench_jsonl(f)] == [False, True, False]
