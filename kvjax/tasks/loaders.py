"""Loaders for real benchmark files the user already has locally (nothing is downloaded).

- `load_ruler_jsonl(path)`: RULER's generated files (`{"index", "input", "outputs", "length",
  ...}`, optionally `query` and `answer_prefix`). The question is the tail of `input` (its
  last line, or the line holding the last occurrence of `query`), plus `answer_prefix`.
  Scored as RULER does: `string_match_part` for the qa tasks, `string_match_all` otherwise.
- `load_longbench_jsonl(path)`: LongBench's files (`{"input", "context", "answers", "length",
  "dataset", "all_classes", "_id"}`), scored with the dataset's LongBench metric.

Both return `Sample`s (`depth=None`; `meta` keeps the record's ids and lengths); score a
prediction with `score_sample(sample, prediction)`. Note `sample.prompt` joins context and
question with one space, which may differ in whitespace from the original prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvjax.tasks import longbench_metrics as lb
from kvjax.tasks import metrics
from kvjax.tasks.sample import Sample

# RULER's tokens_to_generate per task family.
_RULER_MAXLEN = (("niah", 128), ("vt", 30), ("variable_tracking", 30), ("cwe", 120),
                 ("common_words", 120), ("fwe", 50), ("freq_words", 50), ("qa", 32))  # fmt: skip


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    return records


def _require(record: Mapping[str, Any], fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if f not in record]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")


# ---- RULER -------------------------------------------------------------------------------


def ruler_task_name(path: Path) -> str:
    """RULER writes `<save_dir>/<task>/validation.jsonl`; otherwise the file's stem."""
    return path.parent.name if path.stem in ("validation", "test") else path.stem


def _is_qa(task: str) -> bool:
    return re.search(r"(^|_)qa(_|\d|$)", task) is not None


def split_ruler_input(text: str, query: str | None = None) -> tuple[str, str]:
    """(context, question): the question starts at the line holding the last occurrence of
    `query` if given and present, else it is the last non-empty line of `text`."""
    body = text.rstrip()
    at = body.rfind(query) if query else -1
    if at < 0:
        at = len(body)
    cut = body.rfind("\n", 0, at)
    if cut < 0:
        return body, ""
    return body[:cut].rstrip(), body[cut + 1 :].strip()


def load_ruler_jsonl(path: str | Path, task: str | None = None) -> list[Sample]:
    """Samples of a RULER jsonl file; `task` (e.g. "niah_multikey_2", "qa_1") defaults to the
    directory name RULER uses, and picks the metric and the generation budget."""
    path = Path(path)
    task = task or ruler_task_name(path)
    metric = "ruler_string_match_part" if _is_qa(task) else "ruler_string_match_all"
    max_new = next((n for prefix, n in _RULER_MAXLEN if task.startswith(prefix)), 128)
    out = []
    for i, r in enumerate(_read_jsonl(path)):
        _require(r, ("input", "outputs"), f"{path} record {i}")
        outputs = r["outputs"] if isinstance(r["outputs"], list) else [r["outputs"]]
        query = r.get("query")
        if isinstance(query, list):  # multi-query files may list their keys
            query = query[-1] if query else None
        context, question = split_ruler_input(r["input"], query)
        prefix = (r.get("answer_prefix") or "").strip()
        question = f"{question} {prefix}".strip()
        out.append(
            Sample(
                task=task,
                context=context,
                question=question,
                answer=[str(o) for o in outputs],
                target=", ".join(str(o) for o in outputs),
                depth=None,
                max_new_tokens=max_new,
                metric=metric,
                meta={k: r[k] for k in ("index", "length", "token_position_answer") if k in r},
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
    for i, r in enumerate(_read_jsonl(path)):
        _require(r, ("context", "answers"), f"{path} record {i}")
        name = longbench_dataset(r.get("dataset") or dataset or path.stem)
        if name not in lb.DATASET_METRIC:
            known = sorted(lb.DATASET_METRIC)
            raise ValueError(f"{path} record {i}: unknown LongBench dataset {name!r}; known: {known}")
        ctx_t, q_t = templates.get(name, _DEFAULT_TEMPLATE)
        answers = r["answers"] if isinstance(r["answers"], list) else [r["answers"]]
        out.append(
            Sample(
                task=name,
                context=ctx_t.replace("{context}", r["context"]),
                question=q_t.replace("{input}", r.get("input") or ""),
                answer=[str(a) for a in answers],
                target=str(answers[0]) if answers else "",
                depth=None,
                max_new_tokens=lb.DATASET_MAXLEN.get(name, 128),
                metric=lb.DATASET_METRIC[name],
                meta={
                    "all_classes": list(r.get("all_classes") or []),
                    **{k: r[k] for k in ("_id", "length", "language") if k in r},
                },
            )
        )
    return out


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
