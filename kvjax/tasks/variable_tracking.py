"""variable_tracking (RULER's multi-hop tracing): chains of assignments hidden in a haystack.

Statements: "var bako = 40517." ... "var zupe = bako." ... "var tevok = zupe." ...
Question:   "which variables are assigned the value 40517? answer:"
Target:     "bako, zupe, tevok, ..." (the chain in assignment order; any order scores)

One queried chain (1 value + 4 hops = 5 variables) and one distractor chain with another
value. A chain's statements are in order at increasing depths from the requested depth to the
end of the context (the first statement is at the requested depth).
"""

from __future__ import annotations

import numpy as np

from kvjax.tasks import vocab
from kvjax.tasks.base import (
    MIN_HAYSTACK,
    Built,
    Task,
    choose,
    distinct_numbers,
    join_items,
    place,
    spans,
    spell,
    too_small,
)
from kvjax.tasks.haystack import grammar_sentences

VALUE_DIGITS = 5
N_CHAINS = 2
N_HOPS = 4


def chain(names: list[str], value: str) -> list[list[str]]:
    first = ["var", names[0], "=", *spell(value), "."]
    return [first] + [["var", b, "=", a, "."] for a, b in zip(names, names[1:])]


def chain_depths(start: float, count: int) -> list[float]:
    return [start + (1.0 - start) * j / count for j in range(count)]


class VariableTracking(Task):
    name = "variable_tracking"

    def build(self, rng: np.random.Generator, context_length: int, depth: float | None) -> Built:
        n_vars = N_HOPS + 1
        names = choose(rng, vocab.varnames(), N_CHAINS * n_vars)
        values = distinct_numbers(rng, N_CHAINS, VALUE_DIGITS)
        chains = [names[c * n_vars : (c + 1) * n_vars] for c in range(N_CHAINS)]
        needles: list[list[str]] = []
        depths: list[float] = []
        depth = 0.5 if depth is None else depth
        for c, (vars_, value) in enumerate(zip(chains, values)):
            needles += chain(vars_, value)
            depths += chain_depths(depth if c == 0 else float(rng.random()), n_vars)
        question = "which variables are assigned the value".split() + spell(values[0]) + ["?", "answer", ":"]
        needed = 1 + len(question) + sum(map(len, needles)) + MIN_HAYSTACK
        if context_length < needed:
            raise too_small(self.name, context_length, needed)
        budget = context_length - 1 - len(question)
        context, starts = place(rng, grammar_sentences, budget, needles, depths)
        return Built(
            context=context,
            question=question,
            answer=list(chains[0]),
            target=join_items([[v] for v in chains[0]]),
            depth=depth,
            needle_positions=spans(starts[:n_vars], needles[:n_vars]),
        )


TASKS = [VariableTracking()]
