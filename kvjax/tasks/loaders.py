"""Loaders for real benchmark files the user already has locally (nothing is downloaded).

- `load_ruler_jsonl(path)`: RULER's generated files (`{"index", "input", "outputs", "length",
  ...}`, optionally `query` and `answer_prefix`). The question is the tail of `input` (its
  last line, or the line holding the last occurrence of `query`), plus `answer_prefix`.
  Scored as RULER does: `string_match_part` for the qa tasks, `string_match_all` otherwise.
- `load_longbench_jsonl(path)`: LongBench's files (`{"input", "context", "answers", "length",
  "dataset", "all_classes", "_id"}`), scored with the dataset's LongBench metric.

Both return `Sample`s (`depth=None`; `meta` keeps the record's ids, lengths and line);
score a prediction with `score_sample(sample, prediction)`. Note `sample.prompt` joins
context and question with one space, which may differ in whitespace from the original
prompt. A malformed file is a ValueError naming the file and the line.

`benchmark_files(kind, path)` lists the task files of a file or a directory (one task a
file, as both benchmarks publish them), `load_benchmark` reads one, `sha256` names its
bytes in a record, and `take_fraction` picks a share of its samples, the same for a seed.
"""

from __future__ import annotations

import hashlib
import json
import math
from fractions import Fraction
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvjax.tasks import longbench_metrics as lb
from kvjax.tasks import metrics
from kvjax.tasks.sample import Sample

# RULER's tokens_to_generate per task family.
_RULER_MAXLEN = (("niah", 128), ("vt", 30), ("variable_tracking", 30), ("cwe", 120),
                 ("common_words", 120), ("fwe", 50), ("freq_words", 50), ("qa", 32))  # fmt: skip


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of every non-empty line; a line that is not a JSON object is
    refused by its number."""
    records = []
    try:
        with path.open(encoding="utf-8") as f:
            lines = list(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(r, dict):
                raise ValueError(f"{path}:{n}: a JSON object expected, got "
                                 f"{type(r).__name__}")
            records.append((n, r))
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _require(record: Mapping[str, Any], fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if f not in record]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")


def _text(record: Mapping[str, Any], field: str, where: str, optional: bool = False) -> str:
    v = record.get(field)
    if v is None and optional:
        return ""
    if not isinstance(v, str):
        raise ValueError(f"{where}: field {field!r} must be a string, got {v!r:.80}")
    return v


def _answers(record: Mapping[str, Any], field: str, where: str) -> list[str]:
    v = record[field]
    v = v if isinstance(v, list) else [v]
    if not v or any(isinstance(a, (dict, list, bool)) or a is None for a in v):
        raise ValueError(f"{where}: field {field!r} must be a non-empty list of strings or "
                         f"numbers, got {record[field]!r:.80}")
    return [str(a) for a in v]


# ---- RULER -------------------------------------------------------------------------------


def ruler_task_name(path: Path) -> str:
    """RULER writes `<save_dir>/<task>/validation.jsonl`; otherwise the file's stem."""
    return path.parent.name if path.stem in ("validation", "test") else path.stem


def _is_qa(task: str) -> bool:
    return re.search(r"(^|_)qa(_|\d|$)", task) is not None


def split_ruler_input(text: str, query: str | None = None) -> tuple[str, str, str]:
    """(context, sep, question), verbatim: `context + sep + question == text`. The question
    starts at the line holding the last occurrence of `query` if given and present, else at
    the last non-empty line; `sep` is the line break(s) and spaces before it (RULER sends
    `input + answer_prefix` byte for byte, so nothing is stripped or re-joined)."""
    body = text.rstrip()
    at = body.rfind(query) if query else -1
    if at < 0:
        at = len(body)
    cut = body.rfind("\n", 0, at)
    if cut < 0:
        return "", "", text
    start = len(body[:cut].rstrip())
    return text[:start], text[start : cut + 1], text[cut + 1 :]


def load_ruler_jsonl(path: str | Path, task: str | None = None) -> list[Sample]:
    """Samples of a RULER jsonl file; `task` (e.g. "niah_multikey_2", "qa_1") defaults to the
    directory name RULER uses, and picks the metric and the generation budget."""
    path = Path(path)
    task = task or ruler_task_name(path)
    metric = "ruler_string_match_part" if _is_qa(task) else "ruler_string_match_all"
    max_new = next((n for prefix, n in _RULER_MAXLEN if task.startswith(prefix)), 128)
    out = []
    for line, r in read_jsonl(path):
        where = f"{path}:{line}"
        _require(r, ("input", "outputs"), where)
        outputs = _answers(r, "outputs", where)
        query = r.get("query")
        if isinstance(query, list):  # multi-query files may list their keys
            query = query[-1] if query else None
        if query is not None and not isinstance(query, str):
            query = str(query)
        context, sep, question = split_ruler_input(_text(r, "input", where), query)
        question += _text(r, "answer_prefix", where, optional=True)  # as RULER sends it
        out.append(
            Sample(
                task=task,
                context=context,
                sep=sep,
                question=question,
                answer=outputs,
                target=", ".join(outputs),
                depth=None,
                max_new_tokens=max_new,
                metric=metric,
                meta={"line": line,
                      **{k: r[k] for k in ("index", "length", "token_position_answer")
                         if k in r}},
            )
        )
    return out


# ---- LongBench ---------------------------------------------------------------------------

# (context part, question part) per dataset. Modelled on LongBench's prompts (instruction,
# then the context, then the question and an answer cue) but worded for kvjax; pass your own
# `templates` to reproduce a paper's exact prompts. The context part is what a context-only
# evaluation compresses.
_QA = (
    "Read the following text and answer the question after it.\n\n{context}",
    "Answer the question based on the text above, as briefly as possible.\n\n"
    "Question: {input}\nAnswer:",
)
_QA_ZH = ("阅读以下文字，然后回答后面的问题。\n\n{context}", "请根据上文简短回答问题。\n\n问题：{input}\n回答：")
_SUMMARY = (
    "Read the following documents.\n\n{context}",
    "Write a one-page summary of the documents above.\n\nSummary:",
)
_FEW_SHOT = ("Here are some examples.\n\n{context}", "{input}")
_CODE = ("Complete the code below.\n{context}", "Next line of code:\n")
TEMPLATES: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"), _QA),
    "multifieldqa_zh": _QA_ZH,
    "dureader": _QA_ZH,
    "gov_report": _SUMMARY,
    "multi_news": _SUMMARY,
    "qmsum": (
        "Read the following meeting transcript.\n\n{context}",
        "Answer the query about the transcript above in one or more sentences.\n\n"
        "Query: {input}\nAnswer:",
    ),
    "vcsum": ("会议记录：\n{context}", "请总结上面会议的内容。\n\n会议总结："),
    **dict.fromkeys(("trec", "triviaqa", "samsum", "lsht"), _FEW_SHOT),
    "passage_count": (
        "Here are some paragraphs; some of them may be duplicates.\n\n{context}",
        "How many unique paragraphs are there above? Answer with the number only.\n\n"
        "The final answer is:",
    ),
    "passage_retrieval_en": (
        "Here are some numbered paragraphs.\n\n{context}",
        'Which paragraph is this abstract from?\n\n{input}\n\nAnswer in the form "Paragraph 1".'
        "\n\nThe answer is:",
    ),
    "passage_retrieval_zh": (
        "以下是若干段落。\n\n{context}",
        '下面的摘要出自哪一段？\n\n{input}\n\n请按"段落1"的格式回答。\n\n答案是：',
    ),
    "lcc": _CODE,
    "repobench-p": (_CODE[0], "{input}Next line of code:\n"),
}
_DEFAULT_TEMPLATE = ("{context}", "{input}")


def longbench_dataset(name: str) -> str:
    """LongBench-E names (`hotpotqa_e`) map to their base dataset."""
    return name[:-2] if name.endswith("_e") and name[:-2] in lb.DATASET_METRIC else name


def load_longbench_jsonl(
    path: str | Path, dataset: str | None = None, templates: Mapping[str, tuple[str, str]] | None = None
) -> list[Sample]:
    """Samples of a LongBench jsonl file; each record's `dataset` field (else `dataset`, else
    the file stem) picks the metric, the generation budget and the prompt template."""
    path = Path(path)
    templates = {**TEMPLATES, **(templates or {})}
    out = []
    for line, r in read_jsonl(path):
        where = f"{path}:{line}"
        _require(r, ("context", "answers"), where)
        name = r.get("dataset") or dataset or path.stem
        if not isinstance(name, str):
            raise ValueError(f"{where}: field 'dataset' must be a string, got {name!r:.80}")
        name = longbench_dataset(name)
        if name not in lb.DATASET_METRIC:
            known = sorted(lb.DATASET_METRIC)
            raise ValueError(f"{where}: unknown LongBench dataset {name!r}; known: {known}")
        ctx_t, q_t = templates.get(name, _DEFAULT_TEMPLATE)
        answers = _answers(r, "answers", where)
        classes = r.get("all_classes") or []
        if not isinstance(classes, list):
            raise ValueError(f"{where}: field 'all_classes' must be a list or null, got "
                             f"{classes!r:.80}")
        out.append(
            Sample(
                task=name,
                chat=name not in lb.NO_CHAT,
                context=ctx_t.replace("{context}", _text(r, "context", where)),
                question=q_t.replace("{input}", _text(r, "input", where, optional=True)),
                answer=answers,
                target=answers[0],
                depth=None,
                max_new_tokens=lb.DATASET_MAXLEN.get(name, 128),
                metric=lb.DATASET_METRIC[name],
                meta={
                    "all_classes": [str(c) for c in classes],
                    "line": line,
                    **{k: r[k] for k in ("_id", "length", "language") if k in r},
                },
            )
        )
    return out


# ---- benchmark files -------------------------------------------------------------------------

BENCHMARKS = ("ruler", "longbench")


def benchmark_files(kind: str, path: str | Path) -> list[Path]:
    """The task files `--task kind:path` names: the file itself, or a directory's `*.jsonl`
    (and, for RULER's layout `<dir>/<task>/validation.jsonl`, its subdirectories'
    `validation.jsonl` / `test.jsonl`), sorted. Nothing there is an error."""
    if kind not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {kind!r}; known: {', '.join(BENCHMARKS)}")
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{kind}:{path}: no such file or directory")
    files = sorted(path.glob("*.jsonl"))
    if kind == "ruler":
        files += sorted(f for f in path.glob("*/*.jsonl") if f.stem in ("validation", "test"))
    if not files:
        raise FileNotFoundError(f"{kind}:{path}: the directory holds no .jsonl task file")
    return files


def benchmark_task(kind: str, path: Path) -> str:
    """A task file's name in records: `ruler:<task>` (RULER's directory name or the file's
    stem), `longbench:<file stem>`."""
    return f"{kind}:{ruler_task_name(path) if kind == 'ruler' else path.stem}"


def load_benchmark(kind: str, path: str | Path) -> list[Sample]:
    """The samples of one task file of `kind` (`BENCHMARKS`)."""
    if kind == "ruler":
        return load_ruler_jsonl(path)
    if kind == "longbench":
        return load_longbench_jsonl(path)
    raise ValueError(f"unknown benchmark {kind!r}; known: {', '.join(BENCHMARKS)}")


def sha256(path: str | Path) -> str:
    """sha256 of a file's bytes: which data a result was measured on."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def take_fraction(n: int, fraction: float, seed: int, name: str) -> list[int]:
    """ceil(fraction n) of n sample indices, in file order: the first of a permutation
    drawn from (seed, name), so a seed picks the same samples of a task every time, and a
    larger fraction keeps a smaller one's samples (a sweep's cells stay comparable)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    # exact decimal arithmetic: 0.07 * 100 is 7.000000000000001 in floats, and must give 7
    k = math.ceil(Fraction(repr(float(fraction))) * n)
    if k >= n:
        return list(range(n))
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return sorted(int(i) for i in rng.permutation(n)[:k])


# ---- scoring -------------------------------------------------------------------------------


def score_sample(sample: Sample, prediction: str) -> float:
    """Score a prediction for any `Sample` (synthetic, RULER or LongBench), in [0, 1]."""
    if sample.metric in metrics.METRICS:
        return metrics.METRICS[sample.metric](prediction, sample.answer)
    if sample.metric in lb.METRICS:
        return lb.longbench_score(
            sample.task, sample.metric, prediction, sample.answer, sample.meta.get("all_classes", ())
        )
    raise ValueError(f"sample of task {sample.task!r} has unknown metric {sample.metric!r}")
