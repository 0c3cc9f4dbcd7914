"""Synthetic RULER-like long-context tasks, their tokenizer and scorers, and loaders for real
benchmark files.

Why synthetic: no weights or data sets can be downloaded, so kvjax trains its own small model
on these tasks and measures KV-cache compression by accuracy on them. The tasks are learnable
by a tiny word-level model, exactly scorable, deterministic per seed, and exact in length:
`1 + count_tokens(sample.prompt) == context_length` for every sample (1 = `<bos>`).

Scenarios (see `Sample`):
- question-aware: prefill and compress `sample.prompt` (context, then question);
- context-only: prefill and compress `sample.context`, then prefill `sample.question` on top.
  `encode(context) + encode(question) == encode(prompt)`, so the token streams agree.
The model then writes `sample.target` (at most `sample.max_new_tokens` tokens with `<eos>`);
`score(name, prediction, sample.answer)` grades it in [0, 1].

    from kvjax import tasks
    samples = tasks.generate("niah_single", context_length=2048, n=50, seed=0)
    tasks.score("niah_single", prediction, samples[0].answer)
"""

from __future__ import annotations

from collections.abc import Sequence

import numbers

import numpy as np

from kvjax.tasks import aggregation, kv_retrieval, niah, variable_tracking
from kvjax.tasks.base import Task
from kvjax.tasks.haystack import long_text
from kvjax.tasks.loaders import load_longbench_jsonl, load_ruler_jsonl, score_sample
from kvjax.tasks.sample import Sample
from kvjax.tasks.tokenizer import count_tokens, decode, load_tokenizer, save_tokenizer

_REGISTRY: dict[str, Task] = {
    t.name: t for mod in (niah, kv_retrieval, variable_tracking, aggregation) for t in mod.TASKS
}

DESCRIPTIONS = {  # one line each, for --list-tasks
    "common_words": "RULER cwe: list the 10 most common words of a long word list",
    "frequent_words": "RULER fwe: the 3 most frequent coded words of a Zipf-distributed text",
    "kv_retrieval": "the value of one key in a dictionary of number pairs filling the context",
    "niah_multikey": "one needle among 3 distractor needles with other keys",
    "niah_multikey_ruler": "niah_multikey in RULER's own words (for real LLMs)",
    "niah_multiquery": "the values of 4 keys, each with its needle, asked at once",
    "niah_multivalue": "the 4 values of one key, in 4 needles",
    "niah_single": "one 7-digit needle ('the special magic number for KEY is ...') in prose",
    "niah_single_d10": "niah_single with a 10-digit value",
    "niah_single_d3": "niah_single with a 3-digit value",
    "niah_single_d5": "niah_single with a 5-digit value",
    "niah_single_ruler": "niah_single in RULER's own words (for real LLMs)",
    "passkey": "a 5-digit pass key in the repeated 'the grass is green' filler",
    "passkey_prose": "the pass key inside prose instead of the repeated filler",
    "variable_tracking": "RULER vt: every variable a chain of assignments gives a value",
}
assert set(DESCRIPTIONS) == set(_REGISTRY), "every task needs a --list-tasks line"

__all__ = [
    "Sample",
    "Task",
    "count_tokens",
    "decode",
    "fit",
    "generate",
    "get",
    "load_longbench_jsonl",
    "load_ruler_jsonl",
    "load_tokenizer",
    "long_text",
    "names",
    "sample",
    "save_tokenizer",
    "score",
    "score_sample",
    "training_example",
]


def names() -> list[str]:
    """Registered task names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> Task:
    """The task object (`.name`, `.kind`, `.metric`, `.generate`, `.score`, ...)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known: {names()}") from None


def generate(
    name: str, context_length: int = 2048, n: int = 50, seed: int = 0, depth: float | None = None
) -> list[Sample]:
    """`n` deterministic samples of `context_length` tokens (BOS included). With `depth=None`
    sample i's (first) needle is at depth (i + 0.5) / n, so a run covers the context."""
    _check_counts(context_length, n)
    return get(name).generate(context_length=context_length, n=n, seed=seed, depth=depth)


def _check_counts(context_length, n) -> None:
    for what, v in (("context_length", context_length), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{what}={v!r}: expected an integer >= 1")


def fit(name: str, context_length: int, count, n: int = 50, seed: int = 0,
        depth: float | None = None) -> list[Sample]:
    """`generate`, with each prompt fitted to `context_length` tokens of the tokenizer that
    `count(sample)` measures with (`Task.fit`): `--context N` of `kvjax.run` means N tokens
    of the evaluated model."""
    _check_counts(context_length, n)
    return get(name).fit(context_length, count, n=n, seed=seed, depth=depth)


def sample(name: str, context_length: int, rng: np.random.Generator, depth: float | None = None) -> Sample:
    """One sample drawn from `rng` (random depth when None)."""
    return get(name).sample(context_length, rng, depth)


def score(name: str, prediction: str, answer: Sequence[str]) -> float:
    """Grade a prediction against `sample.answer` with the task's metric, in [0, 1]."""
    return get(name).score(prediction, answer)


def training_example(name: str, context_length: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """(`<bos>` + prompt ids, target ids + `<eos>`) with the default tokenizer, random depth."""
    return get(name).training_example(context_length, rng)
