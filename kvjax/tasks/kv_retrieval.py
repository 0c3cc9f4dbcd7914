"""kv_retrieval: a dictionary of random key-value pairs fills the whole context.

Context:  "1234-5678: 8765-4321; 2211-9034: 5510-7723; ..."
Question: "what is the value for key 2211-9034? answer: 2211-9034:"    target: "5510-7723"

The answer prefix restates the key in the dictionary's own form, as the kv-retrieval prompt
of Lost in the Middle (Liu et al., 2023) does ('Key: "K" Corresponding value:').

The hard case for KV-cache compression (ASL / RULER's UUID variant): every pair looks alike,
there is no redundant filler to drop, and the key to find is only known from the question.
A few filler words at the start pad the context to the exact length.
"""

from __future__ import annotations

import numpy as np

from kvjax.tasks.base import Built, Task, distinct_numbers, spans, too_small
from kvjax.tasks.haystack import grammar_sentences

MIN_PAIRS = 4


def half(number: str) -> list[str]:
    """An 8-digit number as "dddd-dddd" tokens."""
    return [*number[:4], "-", *number[4:]]


class KVRetrieval(Task):
    name = "kv_retrieval"
    metric = "exact_contains"

    def build(self, rng: np.random.Generator, context_length: int, depth: float | None) -> Built:
        pair_len = 9 + 1 + 9 + 1
        question_len = 6 + 9 + 3 + 9 + 1
        budget = context_length - 1 - question_len
        n_pairs = budget // pair_len
        if n_pairs < MIN_PAIRS:
            raise too_small(self.name, context_length, 1 + question_len + MIN_PAIRS * pair_len)
        numbers = distinct_numbers(rng, 2 * n_pairs, 8)
        pairs = [half(numbers[2 * i]) + [":"] + half(numbers[2 * i + 1]) + [";"] for i in range(n_pairs)]
        pad = [t for s in grammar_sentences(rng, budget - n_pairs * pair_len) for t in s]
        depth = 0.5 if depth is None else depth
        want = depth * (budget - pair_len) - len(pad)
        q = int(min(max(round(want / pair_len), 0), n_pairs - 1))
        key, value = half(numbers[2 * q]), half(numbers[2 * q + 1])
        question = ["what", "is", "the", "value", "for", "key", *key, "?", "answer", ":", *key, ":"]
        assert len(question) == question_len
        context = pad + [t for p in pairs for t in p]
        start = len(pad) + q * pair_len
        answer = "".join(value)
        return Built(context, question, [answer], value, depth, spans([start], [pairs[q]]))


TASKS = [KVRetrieval()]
