"""Needle-in-a-haystack tasks (RULER's niah_* family) and the classic passkey.

Needle:   "the special magic number for KEY is 4821990."   (KEY: one word of data/keys.txt)
Question: "what is the special magic number for KEY? answer: the special magic number for KEY is"

The question ends with RULER's answer prefix (its synthetic.yaml templates restate the query:
"... The special magic number for KEY mentioned in the provided text is"), so that the answer
is the continuation of the needle, as in RULER and in Landmark Attention's passkey.

- niah_single: one needle.
- niah_multikey: the needle plus 3 distractor needles with other keys.
- niah_multivalue: 4 needles with the same key; answer = the 4 values (target in context order,
  any order scores).
- niah_multiquery: 4 needles with different keys; the question names all 4 (random order) and
  the target lists their values in the question's order.
- passkey: "the pass key is 68231. remember it. 68231 is the pass key." inside the repeated
  "the grass is green. the sky is blue. ..." filler, after the classic instruction.
- niah_single_ruler, niah_multikey_ruler: niah_single and niah_multikey in RULER's own words
  (its intro, "One of the special magic numbers for KEY is: VALUE.", "What is the special
  magic number for KEY mentioned in the provided text? The special magic number for KEY
  mentioned in the provided text is"), for real LLMs: SmolLM2-135M finds the queried key
  among distractors far more often in this rendering (MODEL.md). The tiny model's word
  tokenizer has no "mentioned", "provided", ...: it is not trained on these.
- passkey_prose: the passkey inside grammar sentences instead of the repeated filler.
- niah_single_d3, _d5, _d10: niah_single with a 3-, 5- or 10-digit value, to measure how
  the answer's token count meets a method's pooling kernel (docs/results/pooling.md: a
  tokenizer that spends a token per digit makes niah_single's value 7 tokens).

Needle 0 (the queried one) sits at the requested depth; the other needles are spread around
the context at roughly equal gaps (depth + j / n_needles, wrapped, with some jitter).
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
from kvjax.tasks.haystack import grammar_sentences, repeat_sentences

VALUE_DIGITS = 7


def needle(key: str, value: str) -> list[str]:
    return ["the", "special", "magic", "number", "for", key, "is", *spell(value), "."]


def spread_depths(rng: np.random.Generator, depth: float, count: int) -> list[float]:
    """Needle 0 at `depth`, the others at about equal gaps around the (wrapped) context."""
    out = [depth]
    for j in range(1, count):
        out.append(float((depth + (j + rng.uniform(-0.25, 0.25)) / count) % 1.0))
    return out


# RULER's niah rendering (its synthetic.yaml / constants.py for niah_single_2 and
# niah_multikey_1), words as they are there: the intro before the haystack, the needle
# "One of the special magic numbers for KEY is: VALUE.", the question with its answer prefix.
RULER_INTRO = ("Some special magic numbers are hidden within the following text . Make sure "
               "to memorize it . I will quiz you about the numbers afterwards .").split()


def ruler_needle(key: str, value: str) -> list[str]:
    return ["One", "of", "the", "special", "magic", "numbers", "for", key, "is", ":",
            *spell(value), "."]


def ruler_question(key: str) -> list[str]:
    asked = ["special", "magic", "number", "for", key, "mentioned", "in", "the", "provided",
             "text"]
    return ["What", "is", "the", *asked, "?", "The", *asked, "is"]


class Niah(Task):
    def __init__(self, name: str, n_keys: int, n_values: int, n_queries: int, metric: str,
                 style: str = "kvjax", digits: int = VALUE_DIGITS):
        self.name, self.n_keys, self.n_values, self.n_queries = name, n_keys, n_values, n_queries
        self.metric, self.style, self.digits = metric, style, digits

    def question(self, keys: list[str]) -> list[str]:
        if self.style == "ruler":
            return ruler_question(keys[0])
        plural = self.n_queries > 1 or self.n_values > 1
        noun = ["special", "magic", "numbers" if plural else "number", "for"]
        if self.n_queries > 1:
            named, ask = join_items([[k] for k in keys[:-1]]) + ["and", keys[-1]], "what are the"
        else:
            named, ask = keys[:1], "what are all the" if plural else "what is the"
        return [*ask.split(), *noun, *named, "?", "answer", ":",
                "the", *noun, *named, "are" if plural else "is"]

    def build(self, rng: np.random.Generator, context_length: int, depth: float | None) -> Built:
        keys = choose(rng, vocab.keys(), self.n_keys)
        values = distinct_numbers(rng, self.n_keys * self.n_values, self.digits)
        pairs = [(k, values[i * self.n_values + v]) for i, k in enumerate(keys) for v in range(self.n_values)]
        make = ruler_needle if self.style == "ruler" else needle
        needles = [make(k, v) for k, v in pairs]
        prefix = RULER_INTRO if self.style == "ruler" else []
        queried = choose(rng, keys, self.n_queries) if self.n_queries > 1 else keys[:1]
        question = self.question(queried)
        budget = context_length - 1 - len(question)
        needed = 1 + len(question) + len(prefix) + sum(map(len, needles)) + MIN_HAYSTACK
        if context_length < needed:
            raise too_small(self.name, context_length, needed)
        depth = 0.5 if depth is None else depth
        depths = spread_depths(rng, depth, len(needles))
        context, starts = place(rng, grammar_sentences, budget, needles, depths, prefix=prefix)
        if self.n_queries > 1:  # values in the question's order
            by_key = dict(pairs)
            answer = [by_key[k] for k in queried]
        else:  # values of the queried key, in context order
            mine = sorted((s, v) for s, (k, v) in zip(starts, pairs) if k == queried[0])
            answer = [v for _, v in mine]
        return Built(
            context=context,
            question=question,
            answer=answer,
            # RULER's needles read "is: VALUE", so its answer prefix is continued with ":"
            target=([":"] if self.style == "ruler" else []) + join_items([spell(v) for v in answer]),
            depth=depth,
            needle_positions=spans(starts, needles),
        )


PASSKEY_DIGITS = 5
PASSKEY_INTRO = (
    "there is important info hidden inside a lot of irrelevant text . find it and memorize it . "
    "i will quiz you about the important information there ."
).split()


class Passkey(Task):
    """The classic passkey; `prose`: inside grammar sentences instead of the repeated
    "the grass is green" filler, so the key is not the one sentence that differs."""

    metric = "exact_contains"

    def __init__(self, name: str = "passkey", prose: bool = False):
        self.name, self.prose = name, prose

    def build(self, rng: np.random.Generator, context_length: int, depth: float | None) -> Built:
        value = distinct_numbers(rng, 1, PASSKEY_DIGITS)[0]
        v = spell(value)
        pk = ["the", "pass", "key", "is", *v, ".", "remember", "it", ".", *v, "is", "the", "pass", "key", "."]
        question = "what is the pass key ? answer : the pass key is".split()
        needed = 1 + len(question) + len(PASSKEY_INTRO) + len(pk) + MIN_HAYSTACK
        if context_length < needed:
            raise too_small(self.name, context_length, needed)
        depth = 0.5 if depth is None else depth
        budget = context_length - 1 - len(question)
        filler = grammar_sentences if self.prose else repeat_sentences
        context, starts = place(rng, filler, budget, [pk], [depth], prefix=PASSKEY_INTRO)
        return Built(context, question, [value], list(v), depth, spans(starts, [pk]))


TASKS = [
    Niah("niah_single", n_keys=1, n_values=1, n_queries=1, metric="exact_contains"),
    Niah("niah_multikey", n_keys=4, n_values=1, n_queries=1, metric="string_match_all"),
    Niah("niah_multivalue", n_keys=1, n_values=4, n_queries=1, metric="string_match_all"),
    Niah("niah_multiquery", n_keys=4, n_values=1, n_queries=4, metric="string_match_all"),
    Passkey(),
    # renderings for real LLMs (MODEL.md, SmolLM2): RULER's words, a passkey in prose
    Niah("niah_single_ruler", n_keys=1, n_values=1, n_queries=1, metric="exact_contains",
         style="ruler"),
    Niah("niah_multikey_ruler", n_keys=4, n_values=1, n_queries=1, metric="string_match_all",
         style="ruler"),
    Passkey("passkey_prose", prose=True),
    # the needle's value at other lengths (docs/results/pooling.md)
    *(Niah(f"niah_single_d{d}", n_keys=1, n_values=1, n_queries=1, metric="exact_contains",
           digits=d) for d in (3, 5, 10)),
]
