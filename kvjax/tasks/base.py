"""What every synthetic task shares: exact-length layout, seeding, and `Sample` assembly.

A task builds token lists (every list element is exactly one token of the default tokenizer),
so lengths are exact by construction: the context gets `context_length - 1 - len(question)`
tokens (the 1 is the `<bos>` the engine prepends), and needles are inserted at sentence
boundaries of a haystack generated to exactly the remaining length.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.tasks import metrics
from kvjax.tasks.haystack import Filler
from kvjax.tasks.sample import Sample
from kvjax.tasks.tokenizer import BOS_ID, EOS_ID, render, token_ids

MIN_HAYSTACK = 16  # filler tokens a haystack task keeps at least, besides its needles


@dataclasses.dataclass
class Built:
    """A sample as token lists, before rendering."""

    context: list[str]
    question: list[str]
    answer: list[str]
    target: list[str]
    depth: float | None
    needle_positions: list[tuple[int, int]]  # [start, end) token spans in the BOS+prompt ids


def digits(rng: np.random.Generator, n: int) -> str:
    """A random n-digit number without a leading zero."""
    return str(int(rng.integers(10 ** (n - 1), 10**n)))


def distinct_numbers(rng: np.random.Generator, count: int, n_digits: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        v = digits(rng, n_digits)
        if v not in out:
            out.append(v)
    return out


def choose(rng: np.random.Generator, pool: Sequence[str], k: int) -> list[str]:
    """k distinct items of `pool`, in random order."""
    return [pool[int(i)] for i in rng.choice(len(pool), size=k, replace=False)]


def join_items(items: Sequence[Sequence[str]]) -> list[str]:
    """Token lists joined by "," (the multi-item answer format)."""
    out: list[str] = []
    for i, item in enumerate(items):
        if i:
            out.append(",")
        out.extend(item)
    return out


def spell(word_or_number: str) -> list[str]:
    """Tokens of a word, or of a number (one token per digit)."""
    return list(word_or_number) if word_or_number.isdigit() else [word_or_number]


def too_small(task: str, context_length: int, needed: int) -> ValueError:
    return ValueError(
        f"context_length={context_length} is too small for task {task!r}: it needs at least "
        f"{needed} tokens (<bos>, question, needles or list, minimal filler)"
    )


def place(
    rng: np.random.Generator,
    filler: Filler,
    budget: int,
    needles: Sequence[Sequence[str]],
    depths: Sequence[float],
    prefix: Sequence[str] = (),
) -> tuple[list[str], list[int]]:
    """Context of exactly `budget` tokens: `prefix`, then filler sentences with each needle
    inserted at the sentence boundary nearest to `depth * (budget - len(needle))`.

    Needles are placed in order of depth (ties keep list order, so a chain listed in order
    stays in order). Returns the tokens and each needle's start index in the context.
    """
    hay_n = budget - len(prefix) - sum(len(n) for n in needles)
    if hay_n < 0:
        raise ValueError(f"budget {budget} cannot hold the needles")
    sentences = filler(rng, hay_n)
    bounds = [0]
    for s in sentences:
        bounds.append(bounds[-1] + len(s))
    order = sorted(range(len(needles)), key=lambda j: depths[j])
    at: dict[int, list[int]] = {}
    lo = 0
    placed = 0
    for j in order:
        want = depths[j] * (budget - len(needles[j])) - len(prefix) - placed
        k = bisect.bisect_left(bounds, want, lo=lo)
        if k == len(bounds) or (k > lo and want - bounds[k - 1] <= bounds[k] - want):
            k -= 1
        k = max(k, lo)
        at.setdefault(k, []).append(j)
        lo = k
        placed += len(needles[j])
    out = list(prefix)
    starts = [0] * len(needles)
    for k in range(len(sentences) + 1):
        for j in at.get(k, ()):
            starts[j] = len(out)
            out.extend(needles[j])
        if k < len(sentences):
            out.extend(sentences[k])
    assert len(out) == budget
    return out, starts


class Task:
    """A registered synthetic task. Subclasses implement `build`."""

    name: str = ""
    kind: str = "retrieval"  # or "aggregation"
    metric: str = "string_match_all"

    # -- to implement ----------------------------------------------------------------------
    def build(self, rng: np.random.Generator, context_length: int, depth: float | None) -> Built:
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------
    @functools.cached_property
    def min_context_length(self) -> int:
        """The smallest context_length this task accepts (found by bisection)."""
        lo, hi = 1, 4096  # lo fails, hi works
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                self.build(np.random.default_rng(0), mid, 0.5)
                hi = mid
            except ValueError:
                lo = mid
        return hi

    @property
    def task_id(self) -> int:
        return zlib.crc32(self.name.encode())

    def rng(self, seed: int, context_length: int, index: int) -> np.random.Generator:
        """Sample `index`'s generator: independent of how many samples are drawn."""
        return np.random.default_rng([seed, self.task_id, context_length, index])

    def sample(self, context_length: int, rng: np.random.Generator, depth: float | None = None) -> Sample:
        """One sample from `rng` (random depth when `depth` is None and the task has one)."""
        if depth is None and self.kind == "retrieval":
            depth = float(rng.random())
        return self._to_sample(self.build(rng, context_length, depth))

    def generate(
        self, context_length: int = 2048, n: int = 50, seed: int = 0, depth: float | None = None
    ) -> list[Sample]:
        """`n` samples; with `depth=None`, sample i's needle sits at depth (i + 0.5) / n."""
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth={depth} must be within [0, 1]")
        out = []
        for i in range(n):
            d = None if self.kind == "aggregation" else (depth if depth is not None else (i + 0.5) / n)
            out.append(self._to_sample(self.build(self.rng(seed, context_length, i), context_length, d)))
        return out

    def fit(self, context_length: int, count: Callable[[Sample], int], n: int = 50,
            seed: int = 0, depth: float | None = None) -> list[Sample]:
        """`generate`'s samples with prompts of `context_length` tokens as `count` measures
        them (an evaluated model's tokenizer, BOS and chat markup included), as RULER fits
        its haystack to the model's tokenizer. Each sample keeps its generator and depth;
        only the haystack's length in task words changes (`fit_length`). `meta` gains
        `prompt_tokens` (the count reached: `context_length` exactly where some haystack
        length gives it, else the nearest below) and `task_words`."""
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth={depth} must be within [0, 1]")
        out = []
        for i in range(n):
            d = None if self.kind == "aggregation" else (depth if depth is not None else (i + 0.5) / n)

            def make(words: int, i=i, d=d) -> Sample:
                return self._to_sample(self.build(self.rng(seed, context_length, i), words, d))

            words, s, got = fit_length(make, count, context_length, self.min_context_length,
                                       self.name)
            meta = {k: v for k, v in s.meta.items() if k != "needle_positions"}
            if words == context_length and got == context_length:  # the task's own words
                meta = dict(s.meta)
            out.append(dataclasses.replace(s, meta={**meta, "prompt_tokens": got,
                                                    "task_words": words}))
        return out

    def training_example(
        self, context_length: int, rng: np.random.Generator
    ) -> tuple[list[int], list[int]]:
        """(`<bos>` + prompt ids, answer ids + `<eos>`) for teacher-forced training."""
        depth = float(rng.random()) if self.kind == "retrieval" else None
        b = self.build(rng, context_length, depth)
        return [BOS_ID, *token_ids(b.context + b.question)], [*token_ids(b.target), EOS_ID]

    def score(self, prediction: str, answer: Sequence[str]) -> float:
        return metrics.METRICS[self.metric](prediction, answer)

    def _to_sample(self, b: Built) -> Sample:
        return Sample(
            task=self.name,
            context=render(b.context),
            question=render(b.question),
            answer=list(b.answer),
            target=render(b.target),
            depth=b.depth,
            max_new_tokens=len(b.target) + 1,
            metric=self.metric,
            meta={"needle_positions": b.needle_positions},
        )

    def __repr__(self) -> str:
        return f"<task {self.name} ({self.kind})>"


def fit_length(make: Callable[[int], Sample], count: Callable[[Sample], int], target: int,
               shortest: int, name: str = "") -> tuple[int, Sample, int]:
    """(task words, sample, its count) of the sample `make(words)` whose `count` is
    `target`, or the largest below it where none is. The count grows about linearly with
    the words (a word is 1-2 tokens of a sub-word tokenizer), so a few secant steps on the
    ratio land near the target, then a scan of the neighbouring lengths looks for an exact
    hit (the filler of nearby lengths differs only at its end, so counts move by a token
    or two per word)."""
    seen: dict[int, tuple[int, Sample]] = {}

    def at(words: int) -> int:
        if words not in seen:
            s = make(words)
            seen[words] = (count(s), s)
        return seen[words][0]

    words = max(target, shortest)
    for _ in range(8):
        t = at(words)
        if t == target:
            break
        nxt = max(shortest, round(words * target / t))
        if nxt == words:
            nxt = max(shortest, words + (1 if t < target else -1))
        if nxt in seen:
            break
        words = nxt
    if at(words) != target:  # bisect between the lengths below and above the target
        lo = max((w for w, (t, _) in seen.items() if t < target), default=shortest)
        hi = min((w for w, (t, _) in seen.items() if t > target and w > lo), default=None)
        while hi is not None and hi - lo > 1 and at(lo) != target:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid) <= target else (lo, mid)
        words = lo
    if at(words) != target:
        for step in (d for k in range(1, 25) for d in (k, -k)):
            if words + step >= shortest and at(words + step) == target:
                words += step
                break
    if at(words) != target:
        below = [w for w, (t, _) in seen.items() if t <= target]
        if not below:
            raise ValueError(f"context_length={target} is too small for task {name!r} in "
                             f"this tokenizer: its shortest prompt is {at(shortest)} tokens")
        words = max(below, key=lambda w: (seen[w][0], -w))
    return words, seen[words][1], seen[words][0]


def spans(starts: Sequence[int], needles: Sequence[Sequence[str]]) -> list[tuple[int, int]]:
    """[start, end) spans in BOS-prefixed prompt ids (context index + 1 for `<bos>`)."""
    return [(s + 1, s + 1 + len(n)) for s, n in zip(starts, needles)]
