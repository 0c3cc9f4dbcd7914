"""Aggregation tasks (RULER's cwe and fwe): the answer depends on the whole context, so a
compressed cache cannot keep "the" needle; every token carries a little of the answer.

common_words:   "here is a list of words: pear, owl, pear, lamp, ... ."
                "what are the 10 most common words in the list? answer:"
                target: the 10 common words in order of first appearance. Common words appear
                f times each (f >= 3) and every other word at most f / 2 times (once when the
                list is short enough for the word pool).
frequent_words: "here is the coded text: owl owl pear owl lamp ... ."
                "what are the 3 most frequent words in the text? answer:"
                target: the 3 most frequent words, most frequent first. Counts follow Zipf's
                law (alpha = 2) over a random ranking of the word pool, with strictly
                decreasing counts for the top 4 ranks.
"""

from __future__ import annotations

import numpy as np

from kvjax.tasks import vocab
from kvjax.tasks.base import Built, Task, choose, join_items, too_small

N_COMMON = 10
N_FREQUENT = 3
ZIPF_ALPHA = 2.0


def common_counts(n_entries: int, pool: int) -> tuple[int, list[int]]:
    """(f, counts of the other words) filling exactly `n_entries` list entries, with every
    other word at most f // 2 times; raises ValueError when n_entries is too small."""
    f = 3
    while True:
        rest = n_entries - N_COMMON * f
        if rest < 0:
            raise ValueError(f"{n_entries} entries cannot hold {N_COMMON} words {f} times")
        m = min(pool - N_COMMON, rest)
        if m == 0:
            return f, []
        base, extra = divmod(rest, m)
        if 2 * (base + (extra > 0)) <= f:
            return f, [base + 1] * extra + [base] * (m - extra)
        f += 1


class CommonWords(Task):
    name = "common_words"
    kind = "aggregation"
    min_entries = N_COMMON * 3 + 5

    def build(self, rng: np.random.Generator, context_length: int, depth: float | None) -> Built:
        question = "what are the 1 0 most common words in the list ? answer :".split()
        budget = context_length - 1 - len(question)
        # header length fixes the parity: entries are "word ," pairs, the last "word ."
        header = "here is a list of words :".split()
        if (budget - len(header)) % 2:
            header = "here is a long list of words :".split()
        n = (budget - len(header)) // 2
        if n < self.min_entries:
            raise too_small(self.name, context_length, 1 + len(question) + 7 + 2 * self.min_entries)
        pool = vocab.content_words()
        f, rest = common_counts(n, len(pool))
        words = choose(rng, pool, N_COMMON + len(rest))
        entries = [w for w in words[:N_COMMON] for _ in range(f)]
        entries += [w for w, c in zip(words[N_COMMON:], rest) for _ in range(c)]
        entries = [entries[int(i)] for i in rng.permutation(len(entries))]
        common = set(words[:N_COMMON])
        answer = list(dict.fromkeys(w for w in entries if w in common))
        body = [t for w in entries for t in (w, ",")]
        body[-1] = "."
        return Built(header + body, question, answer, join_items([[w] for w in answer]), None, [])


def zipf_counts(n: int, ranks: int) -> list[int]:
    """Counts summing to n, proportional to 1 / k**alpha (k = 1..ranks), remainder to rank 1."""
    p = 1.0 / np.arange(1, ranks + 1) ** ZIPF_ALPHA
    counts = np.floor(n * p / p.sum()).astype(int)
    counts[0] += n - counts.sum()
    return counts.tolist()


class FrequentWords(Task):
    name = "frequent_words"
    kind = "aggregation"
    min_words = 40

    def build(self, rng: np.random.Generator, context_length: int, depth: float | None) -> Built:
        question = "what are the 3 most frequent words in the text ? answer :".split()
        header = "here is the coded text :".split()
        budget = context_length - 1 - len(question)
        n = budget - len(header) - 1
        if n < self.min_words:
            raise too_small(self.name, context_length, 1 + len(question) + len(header) + 1 + self.min_words)
        pool = vocab.content_words()
        counts = zipf_counts(n, min(len(pool), n))
        if not all(counts[k] > counts[k + 1] for k in range(N_FREQUENT)):
            raise too_small(self.name, context_length, context_length + 1)
        ranked = choose(rng, pool, len(counts))
        text = [w for w, c in zip(ranked, counts) for _ in range(c)]
        text = [text[int(i)] for i in rng.permutation(len(text))]
        answer = ranked[:N_FREQUENT]
        return Built(header + text + ["."], question, answer, join_items([[w] for w in answer]), None, [])


TASKS = [CommonWords(), FrequentWords()]
